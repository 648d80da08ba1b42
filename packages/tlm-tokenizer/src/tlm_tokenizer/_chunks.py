"""Byte ranges of a file that can be pre-tokenised (and encoded) independently.

A cut goes just before an ASCII whitespace byte whose predecessor is printable ASCII: no GPT-2
pre-token crosses such a point (see ``pretokenize``), and both bytes are whole UTF-8 characters,
so every range decodes on its own. A cut is also never inside an occurrence of a special token,
wherever that occurrence starts: then no match of the special tokens can cross it, however the
text before it is matched (overlapping special tokens match differently from different starting
points), so the special tokens on each side are the ones found in the whole text.
"""

import itertools
import os
import re
from typing import BinaryIO

_CUT = re.compile(rb"[\x21-\x7e](?=[ \t\n\r\x0b\x0c])")
_WINDOW = 1 << 16


def spans(data: bytes, cut: int, specials: list[bytes]) -> bool:
    """Whether an occurrence of one of ``specials`` in ``data`` starts before ``cut`` and ends after it."""
    # An occurrence of s lying within [cut - len(s) + 1, cut + len(s) - 1) starts before cut and ends
    # after it, and every one that does lies there.
    return any(data.find(s, max(cut - len(s) + 1, 0), cut + len(s) - 1) >= 0 for s in specials)


def _cut_at_or_after(handle: BinaryIO, offset: int, size: int, specials: list[bytes]) -> int:
    """The first safe cut at or after ``offset`` (``size`` when there is none)."""
    longest = max(map(len, specials), default=0)
    position = offset
    while position < size:
        handle.seek(position)
        window = handle.read(_WINDOW + 1)
        for match in _CUT.finditer(window):
            cut = position + match.end()
            if not specials:
                return cut
            start = max(cut - longest, 0)
            handle.seek(start)
            if not spans(handle.read(2 * longest), cut - start, specials):
                return cut
        position += max(len(window) - 1, 1)  # the last byte again: a cut's whitespace may come next
    return size


def split_file(path: str | os.PathLike[str], parts: int, special_tokens: list[str]) -> list[tuple[int, int]]:
    """About ``parts`` contiguous ``(start, end)`` byte ranges covering the file, cut at safe points."""
    from tlm_core.atomic import open_input  # here, not at the top: see train_bpe

    size = os.path.getsize(path)
    specials = sorted({token.encode("utf-8") for token in special_tokens})
    cuts = [0]
    with open_input(path, "input file") as handle:
        for part in range(1, parts):
            cut = _cut_at_or_after(handle, max(size * part // parts, cuts[-1]), size, specials)
            if cut > cuts[-1]:
                cuts.append(cut)
    if cuts[-1] < size:
        cuts.append(size)
    return [(start, end) for start, end in itertools.pairwise(cuts) if end > start] or [(0, 0)]


def read_range(path: str | os.PathLike[str], start: int, end: int) -> str:
    """The text of bytes ``[start, end)`` of a UTF-8 file, newlines untouched (``\\r\\n`` survives)."""
    from tlm_core.atomic import open_input  # here, not at the top: see train_bpe

    with open_input(path, "input file") as handle:
        handle.seek(start)
        data = handle.read(end - start)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:  # the file and where, not only codec's "can't decode byte 0xff in position 4"
        raise ValueError(f"{os.fspath(path)} is not UTF-8 text ({err.reason} at byte {start + err.start})") from None
