"""encode_file: the raw id array equals tiktoken's ids, and encode()'s, whatever the number of workers."""

import random

import numpy as np
import pytest
from bpe_strategies import CUT_FRAGMENTS, CUT_SPECIALS
from spies import record_bars_and_pools

from tlm_tokenizer import Tokenizer, encode_file
from tlm_tokenizer import _encode_file as encode_file_module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, english_text):
    text = "<|endoftext|>".join(english_text[i : i + 30_011] for i in range(0, 300_000, 30_011)) + " \r\n"
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(text.encode("utf-8"))
    return path, text


@pytest.mark.parametrize("num_workers", [1, 2])
def test_matches_tiktoken(gpt2_tokenizer, tiktoken_gpt2, corpus, tmp_path, monkeypatch, num_workers):
    # Small ranges: the file is cut in many places, inside lines and next to special tokens.
    monkeypatch.setattr(encode_file_module, "_RANGE_BYTES", 20_000)
    path, text = corpus
    out = tmp_path / "ids.bin"
    count = encode_file(gpt2_tokenizer, path, out, num_workers=num_workers)
    ids = np.memmap(out, dtype=np.dtype(gpt2_tokenizer.id_dtype).newbyteorder("<"), mode="r")
    expected = tiktoken_gpt2.encode(text, allowed_special={"<|endoftext|>"})
    assert gpt2_tokenizer.id_dtype == "uint16" and count == len(expected)
    assert ids.tolist() == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.bin"], "temporary files were left behind"


@pytest.fixture(scope="module")
def cut_tokenizer(gpt2_tokenizer):
    return Tokenizer(gpt2_tokenizer.vocab, gpt2_tokenizer.merges, CUT_SPECIALS)


@pytest.mark.parametrize("num_workers", [1, 2, 3, 4])
def test_workers_give_encodes_ids_with_overlapping_specials_around_every_cut(
    cut_tokenizer, tmp_path, monkeypatch, num_workers
):
    # Special tokens with spaces, overlapping each other, everywhere: many candidate cuts fall inside one,
    # and matching from a cut would find different ones than matching the whole text does.
    monkeypatch.setattr(encode_file_module, "_RANGE_BYTES", 64)
    tokenizer = cut_tokenizer
    rng = random.Random(num_workers)
    text = "".join(rng.choice(CUT_FRAGMENTS) for _ in range(2_000))
    (tmp_path / "in.txt").write_bytes(text.encode("utf-8"))
    count = encode_file(tokenizer, tmp_path / "in.txt", tmp_path / "ids.bin", num_workers=num_workers)
    expected = tokenizer.encode(text)
    assert count == len(expected)
    assert np.fromfile(tmp_path / "ids.bin", dtype="<u2").tolist() == expected


def test_a_killed_runs_leftovers_are_removed_by_the_next(gpt2_tokenizer, tmp_path):
    (tmp_path / "in.txt").write_text("some text")
    dead = tmp_path / ".ids.bin.999999999-0123456789abcdef.tmp"  # pid 999999999 does not run
    dead.mkdir()
    (dead / "000000").write_bytes(b"partial")
    encode_file(gpt2_tokenizer, tmp_path / "in.txt", tmp_path / "ids.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.bin", "in.txt"]


def test_uint32_for_large_vocabularies(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)} | {70_000: b"<|big|>"}
    tokenizer = Tokenizer(vocab, [], ["<|big|>"])
    source = tmp_path / "in.txt"
    source.write_bytes("a<|big|>é".encode())
    assert tokenizer.id_dtype == "uint32"
    assert encode_file(tokenizer, source, tmp_path / "out.bin") == 4
    assert np.fromfile(tmp_path / "out.bin", dtype="<u4").tolist() == [97, 70_000, 0xC3, 0xA9]


@pytest.mark.parametrize(
    ("num_workers", "text", "parts", "pools"),
    [
        (1, "word " * 600, 1, []),  # one process reads the file as one range
        (2, "word " * 600, 3, [(2, "fork")]),  # ranges of at most _RANGE_BYTES, at least one per worker
        (4, "word " * 600, 4, [(4, "fork")]),
        (2, "x" * 3_000, 3, []),  # no safe cut: one range, no pool
    ],
)
def test_workers_processes_ranges_and_the_progress_bar(
    gpt2_tokenizer, tmp_path, monkeypatch, num_workers, text, parts, pools
):
    monkeypatch.setattr(encode_file_module, "_RANGE_BYTES", 1_000)
    record = record_bars_and_pools(monkeypatch, encode_file_module)
    asked = []
    real_split = encode_file_module.split_file
    monkeypatch.setattr(encode_file_module, "split_file", lambda *args: asked.append(args[1]) or real_split(*args))
    (tmp_path / "in.txt").write_text(text)
    count = encode_file(gpt2_tokenizer, tmp_path / "in.txt", tmp_path / "ids.bin", num_workers=num_workers)
    assert count == len(gpt2_tokenizer.encode(text))
    assert asked == [parts] and record["pools"] == pools
    (bar,) = record["bars"]
    assert bar.enabled is None and bar.n == 3_000  # None: shown only on a terminal
    assert bar.kwargs == {"total": 3_000, "unit": "B", "unit_scale": True, "desc": "encoding"}


def test_the_default_is_one_process_and_progress_can_be_forced(gpt2_tokenizer, tmp_path, monkeypatch):
    record = record_bars_and_pools(monkeypatch, encode_file_module)
    (tmp_path / "in.txt").write_text("word " * 600)
    encode_file(gpt2_tokenizer, tmp_path / "in.txt", tmp_path / "ids.bin", progress=True)
    assert record["pools"] == [] and [bar.enabled for bar in record["bars"]] == [True]


def test_a_file_ending_inside_a_character_is_refused(gpt2_tokenizer, tmp_path):
    # The last range's decoder is told it has the end: an incomplete UTF-8 sequence there is an error,
    # not silently dropped.
    (tmp_path / "in.txt").write_bytes("text and 日".encode()[:-1])
    with pytest.raises(UnicodeDecodeError, match="unexpected end of data"):
        encode_file(gpt2_tokenizer, tmp_path / "in.txt", tmp_path / "ids.bin")
    assert not (tmp_path / "ids.bin").exists()


def test_failure_leaves_no_output(gpt2_tokenizer, tmp_path):
    source = tmp_path / "bad.txt"
    source.write_bytes(b"valid text, then \xff not UTF-8")
    (tmp_path / "out.bin").write_bytes(b"old")
    with pytest.raises(UnicodeDecodeError):
        encode_file(gpt2_tokenizer, source, tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt", "out.bin"]


def test_bad_arguments(gpt2_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="num_workers must be positive, got 0"):
        encode_file(gpt2_tokenizer, tmp_path / "x", tmp_path / "y", num_workers=0)
    with pytest.raises(TypeError, match="num_workers must be an int, got bool"):
        encode_file(gpt2_tokenizer, tmp_path / "x", tmp_path / "y", num_workers=True)
    with pytest.raises(TypeError, match="tokenizer must be a Tokenizer, got str"):
        encode_file("gpt2", tmp_path / "x", tmp_path / "y")
    with pytest.raises(FileNotFoundError):
        encode_file(gpt2_tokenizer, tmp_path / "absent.txt", tmp_path / "y")
    (tmp_path / "in.txt").write_text("hi")
    with pytest.raises(IsADirectoryError, match="out_path must be a file path, got the folder"):
        encode_file(gpt2_tokenizer, tmp_path / "in.txt", tmp_path)
