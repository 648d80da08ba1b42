"""Hypothesis strategies shared by the tests: text full of ties, repeats, odd whitespace, specials."""

from hypothesis import strategies as st

# Fragments chosen to collide: repeated letters make many equal pair counts (ties), and the
# whitespace covers what GPT-2's pattern treats specially (runs, \r\n, Unicode spaces).
FRAGMENTS = [
    "a", "b", "ab", "ba", "aa", " ", "  ", "\t", "\n", "\n\n", "\r\n", "\u00a0", "\u3000", "\u2028",
    "é", "日本", "'s", "'ll", "1", "23", ".", "!?", " the", "<|eot|>", "<|eot|><|eot|>", "<|", "|>",
    "\x1c", "\x85", " \x1c", "a\x1f",  # whitespace to Python's str, not to GPT-2's \s (and NEL)
    "🤖", "👨\u200d👩\u200d👧", "\U0001f1fa\U0001f1f8", "e\u0301",  # emoji, a ZWJ sequence, a flag, a combining accent
]  # fmt: skip
SPECIALS = ["<|eot|>", "<|eot|><|eot|>"]
# Special tokens with spaces in them, overlapping each other, for the tests of cuts (encode_file's
# ranges): a candidate cut (before a space) can fall inside an occurrence, and which occurrence
# matches depends on where matching starts.
CUT_SPECIALS = ["<|a b|>", "b|> <|a", "<|a b|><|a b|>", "a b", " <|x"]
CUT_FRAGMENTS = [*CUT_SPECIALS, " ", "x", "<|", "|>", "\n", "é", "ab c", "a", "b|>", " <|", "word "]


def texts(min_size: int = 0, max_size: int = 60) -> st.SearchStrategy[str]:
    """Strings built from tie-prone fragments, mixed with arbitrary Unicode."""
    piece = st.one_of(st.sampled_from(FRAGMENTS), st.sampled_from(FRAGMENTS), st.text(max_size=3))
    return st.lists(piece, min_size=min_size, max_size=max_size).map("".join)


# HF tokenizers' regex engine (Oniguruma) knows an older Unicode than the `regex` module that tlm and
# tiktoken use: they split differently around 17,480 code points assigned since Unicode 14 (the lowest,
# U+0558). Texts compared with HF therefore draw arbitrary characters only below U+0530 (Latin, Greek,
# Cyrillic, combining marks), beside the fragments above.
OLD_CHARACTERS = st.characters(max_codepoint=0x52F, exclude_categories=["Cs"])


def hf_texts(max_size: int = 60) -> st.SearchStrategy[str]:
    """Like :func:`texts`, with arbitrary characters only where HF tokenizers and `regex` agree."""
    piece = st.one_of(st.sampled_from(FRAGMENTS), st.sampled_from(FRAGMENTS), st.text(OLD_CHARACTERS, max_size=3))
    return st.lists(piece, max_size=max_size).map("".join)
