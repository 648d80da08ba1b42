"""Every file tlm-tokenizer reads goes through tlm_core's checked open: a FIFO (which a plain ``open`` waits on
for ever), or a folder, in place of an input file is one ValueError naming the argument and the path."""

import os

import pytest

from tlm_tokenizer import Tokenizer, encode_file, train_bpe
from tlm_tokenizer.gpt2_format import read_gpt2_files

BYTES = {i: bytes([i]) for i in range(256)}


needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")


@needs_fifo
@pytest.mark.parametrize("kind", ["fifo", "folder"])
@pytest.mark.parametrize("which", ["vocab_filepath", "merges_filepath"])
def test_gpt2_vocab_and_merges_readers_refuse_what_is_not_a_file(tmp_path, kind, which, not_a_file):
    files = {"vocab_filepath": tmp_path / "vocab.json", "merges_filepath": tmp_path / "merges.txt"}
    files["vocab_filepath"].write_text('{"a": 0}', encoding="utf-8")
    files["merges_filepath"].write_text("#version: 0.2\n", encoding="utf-8")
    files[which].unlink()
    not_a_file.plant(files[which], kind)
    error = not_a_file.raised(lambda: read_gpt2_files(**files))
    assert isinstance(error, ValueError)
    assert str(error) == f"{which} {files[which]}: {not_a_file.KIND[kind]}, expected a regular file"


@needs_fifo
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_encode_file_refuses_an_input_that_is_not_a_file_and_writes_nothing(tmp_path, kind, not_a_file):
    source = not_a_file.plant(tmp_path / "in.txt", kind)
    error = not_a_file.raised(lambda: encode_file(Tokenizer(BYTES, []), source, tmp_path / "ids.bin"))
    assert isinstance(error, ValueError)
    assert str(error) == f"path {source}: {not_a_file.KIND[kind]}, expected a regular file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


@needs_fifo
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_train_bpe_refuses_an_input_that_is_not_a_file(tmp_path, kind, not_a_file):
    source = not_a_file.plant(tmp_path / "in.txt", kind)
    error = not_a_file.raised(lambda: train_bpe(source, 300, [], num_workers=1))
    assert isinstance(error, ValueError)
    assert str(error) == f"input_path {source}: {not_a_file.KIND[kind]}, expected a regular file"


def test_the_checked_readers_still_read_regular_files(tmp_path):
    (tmp_path / "vocab.json").write_text('{"a": 0, "b": 1, "ab": 2}', encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n", encoding="utf-8")
    vocab, merges = read_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert vocab == {0: b"a", 1: b"b", 2: b"ab"} and merges == [(b"a", b"b")]
    (tmp_path / "in.txt").write_bytes(b"abc")
    assert encode_file(Tokenizer(BYTES, []), tmp_path / "in.txt", tmp_path / "ids.bin") == 3
    assert (tmp_path / "ids.bin").read_bytes() == bytes([97, 0, 98, 0, 99, 0])  # little-endian uint16 byte ids
