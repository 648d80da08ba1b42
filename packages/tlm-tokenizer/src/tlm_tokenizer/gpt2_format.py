"""GPT-2's byte-level text form of tokens, and its files ``vocab.json`` and ``merges.txt`` (read only).

GPT-2 stores byte strings as text through a fixed byte -> printable-character table (printable
Latin-1 bytes stand for themselves, the other 68 bytes map to U+0100 onwards), so that a file of
space-separated merges can hold any bytes. HF tokenizers' ``tokenizer.json`` uses the same table
for byte-level BPE. tlm writes ``tokenizer.json``; GPT-2's two files are still read (GPT-2's own
``encoder.json``/``vocab.bpe``, and tokenizer folders written by tlm-tokenizer 0.1).
"""

import json
import os
from functools import cache

from tlm_core.atomic import read_input
from tlm_core.checks import short_repr

__all__ = [
    "bytes_to_unicode",
    "parse_json",
    "parse_merges_txt",
    "parse_vocab_json",
    "read_gpt2_files",
    "text_to_token",
    "token_to_text",
]


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table (the one in its ``encoder.py``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


@cache
def _tables() -> tuple[dict[int, str], dict[int, int | None]]:
    """``str.translate`` tables: Latin-1 character -> GPT-2 character, and back. Going back, a Latin-1
    character that is not in GPT-2's alphabet (a raw space, say) is deleted, so that a changed length
    shows that the text was not byte-level."""
    forward = {byte: char for byte, char in bytes_to_unicode().items()}
    backward: dict[int, int | None] = {code: None for code in range(256)}
    backward.update({ord(char): byte for byte, char in bytes_to_unicode().items()})
    return forward, backward


def token_to_text(token: bytes) -> str:
    """``token`` in GPT-2's byte-level characters (``b" the"`` -> ``"Ġthe"``)."""
    return token.decode("latin-1").translate(_tables()[0])


def text_to_token(text: str, where: str) -> bytes:
    """The bytes that GPT-2 byte-level ``text`` stands for; a ValueError naming ``where`` if it is not that."""
    raw = text.translate(_tables()[1])
    if len(raw) == len(text):
        try:
            return raw.encode("latin-1")
        except UnicodeEncodeError:
            pass
    alphabet = set(bytes_to_unicode().values())
    bad = next(char for char in text if char not in alphabet)
    raise ValueError(f"{where}: expected GPT-2 byte-level characters, got {bad!r} in {short_repr(text)}")


def parse_vocab_json(data: bytes, where: str) -> dict[int, bytes]:
    """id -> bytes from the bytes of a GPT-2 ``vocab.json`` (token text -> id); ``where`` names the file."""
    raw = parse_json(data, where)
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object of token -> id, got {type(raw).__name__}")
    vocab: dict[int, bytes] = {}
    for text, index in raw.items():
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"{where}: expected int ids, got {short_repr(index)} for {short_repr(text)}")
        if index in vocab:
            raise ValueError(f"{where}: expected distinct ids, got {index} for two tokens")
        vocab[index] = text_to_token(text, where)
    return vocab


def parse_merges_txt(data: bytes, where: str) -> list[tuple[bytes, bytes]]:
    """The merges, in rank order, from the bytes of a GPT-2 ``merges.txt`` (``#version`` line optional)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{where}: expected UTF-8 text, got byte {data[error.start]:#04x} at {error.start}") from None
    merges = []
    for number, line in enumerate(text.split("\n")):
        line = line.rstrip("\r")
        if (number == 0 and line.startswith("#version")) or not line.strip():
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{where}: expected two tokens on line {number + 1}, got {short_repr(line)}")
        merges.append((text_to_token(parts[0], where), text_to_token(parts[1], where)))
    return merges


def read_gpt2_files(
    vocab_filepath: str | os.PathLike[str], merges_filepath: str | os.PathLike[str]
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Read GPT-2-format ``vocab.json`` and ``merges.txt`` into ``(vocab, merges)`` of bytes."""
    vocab = parse_vocab_json(read_input(vocab_filepath, "vocab_filepath"), os.fspath(vocab_filepath))
    merges = parse_merges_txt(read_input(merges_filepath, "merges_filepath"), os.fspath(merges_filepath))
    return vocab, merges


def parse_json(data: bytes, where: str) -> object:
    """``json.loads(data)``; a ValueError naming ``where`` in one line if it is not UTF-8 JSON."""
    try:
        return json.loads(data)
    except UnicodeDecodeError as error:
        raise ValueError(f"{where}: expected UTF-8 JSON, got byte {data[error.start]:#04x} at {error.start}") from None
    except ValueError as error:  # json.JSONDecodeError
        raise ValueError(f"{where}: not JSON ({error})") from None
