"""pretokenize (re on ASCII stretches, regex around the rest) against GPT-2's pattern run by regex alone."""

import pytest
import regex
from bpe_strategies import texts
from hypothesis import given, settings
from hypothesis import strategies as st

from tlm_tokenizer import pretokenize as module
from tlm_tokenizer.pretokenize import ASCII_PRETOKEN, count_pretokens, pretokenize, special_splitter

# Written out again here from the course handout rather than imported from the package.
GPT2 = regex.compile(r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

# Every ASCII character, plus the strings where the pattern's alternatives compete.
ASCII_PIECES = [chr(code) for code in range(128)] + ["'s", "'ll", "'re", "'ve", "'d", "'t", "'m", " a", "  ", "\r\n"]
OTHER_PIECES = ["é", "日本", "\u00a0", "\u3000", "\u2028", "\x85", "🤖", "£", "\ufeff", "Ωμέγα", "²", "٣"]


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from(ASCII_PIECES), max_size=40).map("".join))
def test_ascii_pattern_equals_gpt2_pattern_on_ascii(text):
    assert text.isascii()
    assert ASCII_PRETOKEN.findall(text) == GPT2.findall(text)


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.one_of(st.sampled_from(ASCII_PIECES), st.sampled_from(OTHER_PIECES), texts(max_size=3))),
    look_back=st.sampled_from([1, 2, 5, 4096]),
    block=st.sampled_from([1, 3, 7, 65536]),
    dense_min=st.sampled_from([0, 2, 64]),
)
def test_mixed_text_equals_gpt2_pattern(pieces, look_back, block, dense_min):
    # Small blocks and look-back windows put cuts and block edges everywhere, runs split across blocks
    # included, and a small dense_min hands the rest of the text to regex at any point; the result
    # must not depend on them.
    text = "".join(pieces)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "_LOOK_BACK", look_back)
        patch.setattr(module, "_SCAN_BLOCK", block)
        patch.setattr(module, "_DENSE_MIN", dense_min)
        assert pretokenize(text) == GPT2.findall(text)


def test_long_mixed_text_equals_gpt2_pattern(english_text):
    text = english_text[:100_000]
    for position in (0, 17, 5_000, 65_535, 65_536, 99_999):  # non-ASCII at block edges and far from cuts
        text = text[:position] + "é" + text[position + 1 :]
    pieces = pretokenize(text)
    assert pieces == GPT2.findall(text)
    assert "".join(pieces) == text


def test_densely_mixed_text_equals_gpt2_pattern(english_text):
    # An accented word every few words: past _DENSE_MIN stretches the rest goes to regex whole.
    words = english_text[:50_000].split(" ")
    text = " ".join(word.replace("e", "é", 1) if index % 3 == 0 else word for index, word in enumerate(words))
    assert pretokenize(text) == GPT2.findall(text)


def test_count_pretokens_skips_special_tokens():
    splitter = special_splitter(["<|eot|>", "<|eot|><|eot|>"])
    counts = count_pretokens("a cat<|eot|><|eot|> cat<|eot|>é cat", splitter)
    assert counts == {"a": 1, " cat": 3, "é": 1}
