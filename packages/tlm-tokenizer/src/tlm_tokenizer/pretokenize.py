"""GPT-2 pre-tokenisation at the speed of the standard library's ``re`` wherever the text is ASCII.

GPT-2's pattern needs Unicode classes (``\\p{L}``, ``\\p{N}``), which only the third-party ``regex``
module has, and ``regex`` runs it slower than ``re`` runs the same pattern written for ASCII. So ASCII text
goes through ``re`` (``ASCII_PRETOKEN``), and in mixed text only the stretches around non-ASCII characters
go through ``regex``, cut at points no pre-token crosses.

A safe cut: just before an ASCII whitespace character whose predecessor is printable ASCII. GPT-2's
pattern has no look-behind, no pre-token holds a non-space followed by a space (only the leading
space of `` ?\\p{L}+`` and the like, and whitespace runs), and its one look-ahead ``(?!\\S)`` only
follows whitespace, so the text before such a point ends its last pre-token there, and the pattern
restarted at the point finds what it found in context.
"""

import functools
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

__all__ = ["ASCII_PRETOKEN", "GPT2_PATTERN", "count_pretokens", "pretokenize", "special_splitter"]

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same pattern for ASCII-only text: there \p{L} is [A-Za-z], \p{N} is [0-9], and regex's \s is
# these six characters (re's \s would add \x1c-\x1f, which GPT-2's pattern counts as punctuation).
# The tests check the two agree on generated ASCII and mixed text.
_SPACE = r"\t\n\x0b\x0c\r "
ASCII_PRETOKEN = re.compile(
    rf"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^{_SPACE}A-Za-z0-9]+|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+"""
)
_ascii_findall = ASCII_PRETOKEN.findall
_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
_SCAN_BLOCK = 1 << 16  # a slice's isascii() is a memory-speed scan, far cheaper than searching it with re
# A safe cut is the end of a match of _CUT (first after a position) or of _LAST_CUT (last before one).
_CUT = re.compile(rf"[\x21-\x7e](?=[{_SPACE}])")
_LAST_CUT = re.compile(rf".*[\x21-\x7e](?=[{_SPACE}])", re.DOTALL)
_LOOK_BACK = 1 << 12  # how far before a non-ASCII character to look for a cut (else: from the last one)
# Past _DENSE_MIN stretches, more than one per _DENSE_SPACING characters sends the rest of the text to
# regex, where cutting the stretches out costs more than it saves (docs/benchmarks.md).
_DENSE_MIN = 64
_DENSE_SPACING = 100
# Last position p <= endpos-1 with text[p-1] non-whitespace and text[p] ASCII whitespace: where
# encode_iterable may cut a stream (re's \S is narrower than regex's, so this never cuts where GPT-2
# would not).
LAST_WHITESPACE_CUT = re.compile(r".*\S(?=[\t\n\x0b\x0c\r ])", re.DOTALL)


@functools.cache
def unicode_findall() -> Callable[..., list[str]]:
    """``findall`` of GPT2_PATTERN compiled by ``regex`` (imported on first use: ASCII text never needs it)."""
    import regex

    return regex.compile(GPT2_PATTERN).findall


def pretokenize(text: str) -> list[str]:
    """GPT-2's pre-tokens of ``text``, in order: ``regex.findall(GPT2_PATTERN, text)``, only faster."""
    if text.isascii():  # O(1): CPython records it
        return _ascii_findall(text)
    unicode = unicode_findall()
    pieces: list[str] = []
    done = 0  # text[:done] is pre-tokenised, and done is a safe cut (or 0)
    stretches = 0
    for run in _non_ascii_runs(text):
        if run.start() < done:
            continue
        stretches += 1
        if stretches > _DENSE_MIN and stretches * _DENSE_SPACING > done:
            break  # non-ASCII everywhere: cutting out stretches costs more than regex saves
        before = _LAST_CUT.match(text, max(done, run.start() - _LOOK_BACK), run.start())
        start = before.end() if before is not None else done
        after = _CUT.search(text, run.end())
        end = after.end() if after is not None else len(text)
        if start > done:
            pieces += _ascii_findall(text, done, start)
        pieces += unicode(text, start, end)
        done = end
    else:
        if done < len(text):
            pieces += _ascii_findall(text, done)
        return pieces
    pieces += unicode(text, done)
    return pieces


def _non_ascii_runs(text: str) -> Iterator[re.Match[str]]:
    """Runs of non-ASCII characters, in order (a run across a block boundary comes in two parts)."""
    for low in range(0, len(text), _SCAN_BLOCK):
        if not text[low : low + _SCAN_BLOCK].isascii():
            yield from _NON_ASCII.finditer(text, low, low + _SCAN_BLOCK)


def special_splitter(special_tokens: Iterable[str]) -> re.Pattern[str] | None:
    """A pattern whose ``split`` alternates text and special tokens, the longest special first."""
    ordered = sorted(set(special_tokens), key=lambda token: (-len(token), token))
    if not ordered:
        return None
    return re.compile("(" + "|".join(map(re.escape, ordered)) + ")")


def count_pretokens(text: str, splitter: re.Pattern[str] | None) -> dict[str, int]:
    """Pre-token -> count in ``text``, split at special tokens first (specials are not counted)."""
    counts: Counter[str] = Counter()
    for segment in splitter.split(text)[::2] if splitter is not None else (text,):
        counts.update(pretokenize(segment))
    return dict(counts)
