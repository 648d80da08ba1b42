"""split_file's cuts (used by encode_file's workers and train_bpe's counting): encoding the ranges one by
one gives the ids of the whole file, even with overlapping special tokens placed around every cut."""

import random
from itertools import pairwise

import pytest
from bpe_strategies import CUT_FRAGMENTS, CUT_SPECIALS

from tlm_tokenizer import Tokenizer
from tlm_tokenizer import _chunks as module
from tlm_tokenizer._chunks import read_range, spans, split_file


@pytest.fixture(scope="module")
def tokenizer(gpt2_tokenizer):
    return Tokenizer(gpt2_tokenizer.vocab, gpt2_tokenizer.merges, CUT_SPECIALS)


@pytest.mark.parametrize("seed", range(12))
def test_ranges_encode_to_the_ids_of_the_whole_file(tokenizer, tmp_path, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(CUT_FRAGMENTS) for _ in range(300))
    path = tmp_path / "text.txt"
    path.write_bytes(text.encode("utf-8"))
    whole = tokenizer.encode(text)
    for parts in (2, 5, 17, 300):
        ranges = split_file(path, parts, tokenizer.special_tokens)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(text.encode())
        assert all(end == start for (_, end), (start, _) in pairwise(ranges))
        assert [i for start, end in ranges for i in tokenizer.encode(read_range(path, start, end))] == whole
    assert len(split_file(path, 300, tokenizer.special_tokens)) > 10, "the special tokens left no cut"


def test_a_file_without_a_safe_cut_is_one_range(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(b"no-space-anywhere" * 100)
    assert split_file(path, 8, []) == [(0, 1700)]
    path.write_bytes(b"")
    assert split_file(path, 8, []) == [(0, 0)]


def test_cuts_fall_before_whitespace_after_printable_ascii(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(b"aaaa bbbb\tcccc\ndddd  eeee")
    cuts = [start for start, _ in split_file(path, 25, [])][1:]
    assert cuts == [4, 9, 14, 19]  # never between the two spaces: "  " is one pre-token with the next word


@pytest.mark.parametrize("window", [1, 2, 3, 5, 1 << 16])
def test_cuts_do_not_depend_on_the_read_window(tmp_path, monkeypatch, window):
    # The file is read in windows; a cut whose whitespace byte starts the next window is still found.
    monkeypatch.setattr(module, "_WINDOW", window)
    path = tmp_path / "text.txt"
    path.write_bytes(b"aaaa bbbb\tcccc\ndddd  eeee")
    assert [start for start, _ in split_file(path, 25, [])][1:] == [4, 9, 14, 19]


def test_each_part_after_a_long_stretch_without_cuts_looks_past_the_last_cut(tmp_path):
    # Parts 1-4 of 10 all fall in the 40 bytes before the first cut: each later part searches from
    # the last cut found, not from its own offset, so that the file still splits into many ranges.
    path = tmp_path / "text.txt"
    path.write_bytes(b"a" * 40 + b" b c d e f g h")
    assert [start for start, _ in split_file(path, 10, [])][1:] == [40, 42, 44, 46, 48, 50, 52]


def test_spans():
    data = b"xx<|a b|>yy"
    assert spans(data, 5, [b"<|a b|>"]) and spans(data, 3, [b"<|a b|>"]) and spans(data, 8, [b"<|a b|>"])
    assert not spans(data, 2, [b"<|a b|>"]) and not spans(data, 9, [b"<|a b|>"])
    assert not spans(data, 5, []) and not spans(data, 5, [b"zz"])
