"""Byte ranges of a file that can be pre-tokenised (and encoded) independently.

A cut goes just before an ASCII whitespace byte whose predecessor is printable ASCII: no GPT-2
pre-token crosses such a point (see ``pretokenize``), and both bytes are whole UTF-8 characters,
so every range decodes on its own. A cut that would fall inside a special token moves to its start.
"""

from __future__ import annotations

import itertools
import os
import re

TYPE_CHECKING = False  # typing itself is not imported: it costs a course-sized training run 10%
if TYPE_CHECKING:
    from typing import BinaryIO

_CUT = re.compile(rb"[\x21-\x7e](?=[ \t\n\r\x0b\x0c])")
_WINDOW = 1 << 16


def _cut_at_or_after(handle: BinaryIO, offset: int, size: int, specials: re.Pattern[bytes] | None, longest: int) -> int:
    position = offset
    while position < size:
        handle.seek(position)
        window = handle.read(_WINDOW + 1)
        match = _CUT.search(window)
        if match is None or match.end() >= len(window):
            position += max(len(window) - 1, 1)
            continue
        cut = position + match.end()
        if specials is not None:
            start = max(cut - longest, 0)
            handle.seek(start)
            around = handle.read(2 * longest)
            for special in specials.finditer(around):
                if start + special.start() < cut < start + special.end():
                    cut = start + special.start()
                    break
        return max(cut, offset)
    return size


def split_file(path: str | os.PathLike, parts: int, special_tokens: list[str]) -> list[tuple[int, int]]:
    """About ``parts`` contiguous ``(start, end)`` byte ranges covering the file, cut at safe points."""
    size = os.path.getsize(path)
    encoded = sorted({token.encode("utf-8") for token in special_tokens}, key=len, reverse=True)
    specials = re.compile(b"|".join(map(re.escape, encoded))) if encoded else None
    longest = max(map(len, encoded), default=0)
    cuts = [0]
    with open(path, "rb") as handle:
        for part in range(1, parts):
            cut = _cut_at_or_after(handle, max(size * part // parts, cuts[-1]), size, specials, longest)
            if cut > cuts[-1]:
                cuts.append(cut)
    if cuts[-1] < size:
        cuts.append(size)
    return [(start, end) for start, end in itertools.pairwise(cuts) if end > start] or [(0, 0)]


def read_range(path: str | os.PathLike, start: int, end: int) -> str:
    """The text of bytes ``[start, end)`` of a UTF-8 file, newlines untouched (``\\r\\n`` survives)."""
    with open(path, "rb") as handle:
        handle.seek(start)
        return handle.read(end - start).decode("utf-8")
