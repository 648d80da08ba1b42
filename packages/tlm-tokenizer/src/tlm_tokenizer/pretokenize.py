"""GPT-2 pre-tokenisation, run once per distinct space-delimited chunk instead of over the whole text.

GPT-2's pattern has no look-behind, and no pre-token contains a space followed by something other
than its own letters, digits or punctuation. So at every space that is followed by a non-space the
text splits into pieces that the pattern tokenises independently: a split there is never crossed by
a pre-token, and the pattern's result on each piece alone equals its result in context (the piece
before such a space ends in whatever precedes it, and the look-ahead ``(?!\\S)`` sees a space, like
the end of text). Splitting with a plain ``re`` (C speed) and running the expensive Unicode pattern
only on distinct pieces removes most of the regex cost on natural text.

A second kind of safe cut, used to split files and streams: just before a whitespace character
whose predecessor is not whitespace (no pre-token ends in a non-space and continues with a space).
"""

import re
from collections import Counter
from collections.abc import Iterable

import regex

__all__ = ["GPT2_PATTERN", "count_pretokens", "special_splitter"]

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PRETOKEN = regex.compile(GPT2_PATTERN)

# Pieces after the first each stood behind one space, which the split consumed. (re's \S is a
# subset of regex's: Python also counts \x1c-\x1f as space, so this never cuts where GPT-2 would not.)
SPACE_SPLIT = re.compile(r" (?=\S)").split
# Cuts just before ASCII whitespace that follows a non-space (see module doc): splits a chunk
# such as "said.\nLet" so its parts are cached on their own. ASCII only, where re and regex agree.
TRANSITION_SPLIT = re.compile(r"(?<=\S)(?=[\t\n\x0b\x0c\r ])").split
# Last position p <= endpos-1 with text[p-1] non-whitespace and text[p] ASCII whitespace.
LAST_WHITESPACE_CUT = re.compile(r".*\S(?=[\t\n\x0b\x0c\r ])", re.DOTALL)


def special_splitter(special_tokens: Iterable[str]) -> re.Pattern[str] | None:
    """A pattern whose ``split`` alternates text and special tokens, the longest special first."""
    ordered = sorted(set(special_tokens), key=lambda token: (-len(token), token))
    if not ordered:
        return None
    return re.compile("(" + "|".join(map(re.escape, ordered)) + ")")


def count_pretokens(text: str, splitter: re.Pattern[str] | None) -> dict[str, int]:
    """Pre-token -> count in ``text``, split at special tokens first (specials are not counted)."""
    segments = splitter.split(text)[::2] if splitter is not None else [text]
    spaced: Counter[str] = Counter()
    firsts: Counter[str] = Counter()
    for segment in segments:
        pieces = SPACE_SPLIT(segment)
        spaced.update(pieces)
        spaced[pieces[0]] -= 1
        firsts[pieces[0]] += 1
    # Chunks holding a newline recur mostly as their parts ("said.\nLet" -> "said.", "\nLet"), so
    # count parts before running the pattern; the first part of a spaced chunk keeps its space.
    parts: dict[str, int] = {}
    for chunks, prefix in ((spaced, " "), (firsts, "")):
        for chunk, count in chunks.items():
            if count <= 0:
                continue
            # Printable and space-free: no ASCII whitespace inside, so nothing to split.
            if chunk.isprintable() and " " not in chunk:
                part = prefix + chunk
                parts[part] = parts.get(part, 0) + count
                continue
            for part in TRANSITION_SPLIT(prefix + chunk):
                parts[part] = parts.get(part, 0) + count
    counts: dict[str, int] = {}
    for part, count in parts.items():
        if (part[1:] if part[:1] == " " else part).isalpha():  # str.isalpha is \p{L}: one pre-token
            counts[part] = counts.get(part, 0) + count
            continue
        for token in PRETOKEN.findall(part):
            counts[token] = counts.get(token, 0) + count
    return counts
