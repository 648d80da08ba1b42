"""GPT-2's file format: ``vocab.json`` (token string -> id) and ``merges.txt`` (one merge a line).

GPT-2 stores byte strings as text through a fixed byte -> printable-character table (printable
Latin-1 bytes stand for themselves, the other 68 bytes map to U+0100 onwards), so that a file of
space-separated merges can hold any bytes. Any tool that reads GPT-2's files reads ours.
"""

import json
import os
import pathlib
from functools import cache

__all__ = ["bytes_to_unicode", "read_gpt2_files", "write_gpt2_files"]


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
def _unicode_to_bytes() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _to_text(token: bytes) -> str:
    table = bytes_to_unicode()
    return "".join(table[byte] for byte in token)


def _to_bytes(text: str, where: str) -> bytes:
    table = _unicode_to_bytes()
    try:
        return bytes(table[char] for char in text)
    except KeyError as missing:
        raise ValueError(
            f"{where}: expected GPT-2 byte-level characters, got {missing.args[0]!r} in {text!r}"
        ) from None


def read_gpt2_files(
    vocab_filepath: str | os.PathLike, merges_filepath: str | os.PathLike
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Read GPT-2-format ``vocab.json`` and ``merges.txt`` into ``(vocab, merges)`` of bytes."""
    with open(vocab_filepath, encoding="utf-8") as handle:
        raw = json.load(handle)
    if not isinstance(raw, dict) or not all(isinstance(i, int) for i in raw.values()):
        raise ValueError(
            f"vocab_filepath: expected a JSON object of token -> id, got {type(raw).__name__} in {vocab_filepath}"
        )
    vocab = {index: _to_bytes(text, str(vocab_filepath)) for text, index in raw.items()}
    merges = []
    with open(merges_filepath, encoding="utf-8", newline="") as handle:
        for number, line in enumerate(handle):
            line = line.rstrip("\r\n")
            if (number == 0 and line.startswith("#version")) or not line.strip():
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"merges_filepath: expected two tokens on line {number + 1}, got {line!r}")
            merges.append((_to_bytes(parts[0], str(merges_filepath)), _to_bytes(parts[1], str(merges_filepath))))
    return vocab, merges


def write_gpt2_files(
    folder: pathlib.Path, vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]]
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``vocab.json`` and ``merges.txt`` into ``folder`` (the caller makes this atomic)."""
    encoder = {_to_text(token): index for index, token in sorted(vocab.items())}
    if len(encoder) != len(vocab):
        raise ValueError("vocab: expected distinct byte strings, got duplicates (GPT-2's vocab.json maps each once)")
    vocab_path, merges_path = folder / "vocab.json", folder / "merges.txt"
    vocab_path.write_text(json.dumps(encoder, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2", *(f"{_to_text(a)} {_to_text(b)}" for a, b in merges)]
    merges_path.write_text("\n".join(lines) + "\n", encoding="utf-8", newline="")
    return vocab_path, merges_path
