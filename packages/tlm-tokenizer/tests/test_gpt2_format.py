"""GPT-2's byte-level text and its files vocab.json and merges.txt (GPT-2's own encoder.json and
vocab.bpe included), against tiktoken and HF tokenizers."""

import json

import pytest

from tlm_tokenizer import Tokenizer, bytes_to_unicode
from tlm_tokenizer.gpt2_format import parse_merges_txt, text_to_token, token_to_text

tokenizers = pytest.importorskip("tokenizers")


def test_byte_table_is_hf_tokenizers_byte_level_alphabet():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert sorted(table.values()) == sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("!")] == "!"


def test_text_and_bytes_convert_both_ways():
    every_byte = bytes(range(256))
    assert text_to_token(token_to_text(every_byte), "here") == every_byte
    assert token_to_text(b" the\n") == "ĠtheĊ"


@pytest.mark.parametrize("text", ["a b", "\x00", "€", "Ġ\u0100x\t"])
def test_text_that_is_not_byte_level_is_refused(text):
    with pytest.raises(ValueError, match="here: expected GPT-2 byte-level characters, got"):
        text_to_token(text, "here")


def test_gpt2s_files_give_tiktokens_tokens(gpt2_tokenizer, tiktoken_gpt2):
    vocab = gpt2_tokenizer.vocab  # from_files: parse_vocab_json and parse_merges_txt of GPT-2's own files
    assert len(vocab) == 50_257 and vocab[50_256] == b"<|endoftext|>"
    assert all(vocab[index] == tiktoken_gpt2.decode_single_token_bytes(index) for index in range(50_256))
    assert len(gpt2_tokenizer.merges) == 50_000 and gpt2_tokenizer.merges[0] == (b" ", b"t")


def test_merges_txt_lines(tmp_path):
    data = "#version: 0.2\r\na b\r\n\r\nĠ t\n".encode()
    assert parse_merges_txt(data, "m") == [(b"a", b"b"), (b" ", b"t")]
    assert parse_merges_txt(b"a b", "m") == [(b"a", b"b")]  # no #version line, no final newline


FILE_ERRORS = [
    ("vocab.json", b"[1, 2]", "expected a JSON object of token -> id, got list"),
    ("vocab.json", b'{"a": "1"}', "expected int ids, got '1' for 'a'"),
    ("vocab.json", b'{"a": 1, "b": 1}', "expected distinct ids, got 1 for two tokens"),
    ("vocab.json", b'{"a": 1, "a b": 2}', "expected GPT-2 byte-level characters, got ' ' in 'a b'"),
    ("merges.txt", b"a b c\n", "expected two tokens on line 1, got 'a b c'"),
    ("merges.txt", b"#version: 0.2\na \xff\n", "expected UTF-8 text, got byte 0xff at 16"),
]


def write_files(folder) -> tuple:
    """A small vocab.json and merges.txt: the 256 bytes and the merge (a, b); returns their paths."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()} | {"ab": 256}
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\na b\n", encoding="utf-8")
    return folder / "vocab.json", folder / "merges.txt"


def test_small_files_load_with_special_tokens(tmp_path):
    assert Tokenizer.from_files(*write_files(tmp_path), ["<|endoftext|>"]).encode("abc<|endoftext|>") == [256, 99, 257]


@pytest.mark.parametrize(("name", "data", "message"), FILE_ERRORS)
def test_a_malformed_file_is_refused_naming_it(tmp_path, name, data, message):
    paths = write_files(tmp_path)
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError) as raised:
        Tokenizer.from_files(*paths)
    assert str(raised.value).startswith(f"{tmp_path / name}: ") and message in str(raised.value)


def test_files_that_make_no_tokenizer_are_refused(tmp_path):
    paths = write_files(tmp_path)
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ zzzq\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"merges\[0\] \(b' ', b'zzzq'\) needs b'zzzq', which vocab lacks"):
        Tokenizer.from_files(*paths)
