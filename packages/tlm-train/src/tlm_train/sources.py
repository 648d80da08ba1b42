"""The documents of ``--data`` files, read as streams: plain text (one document per file), JSON Lines (one
document per line, its text in a named field) and either compressed with gzip (``.gz``) or Zstandard (``.zst``,
with the optional ``zstandard`` package: ``pip install 'tlm-train[zstd]'``).

The kind comes from the name: ``corpus.jsonl.zst`` is JSON Lines in Zstandard, ``book.txt.gz`` (or ``book.gz``)
gzip'd text. Nothing is read whole: a text file comes in chunks and JSON Lines line by line, so a corpus
larger than memory goes through :func:`write_corpus` into one file that the tokenizer trains on and encodes.
"""

import codecs
import gzip
import io
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, runtime_checkable

COMPRESSED = (".gz", ".zst")
JSONL = (".jsonl",)
_CHUNK = 1 << 20


@runtime_checkable
class Readable(Protocol):
    """A binary stream to read: a file, a ``gzip.GzipFile``, a Zstandard stream reader."""

    def read(self, size: int = -1, /) -> bytes: ...


@runtime_checkable
class Writable(Protocol):
    """A binary stream to write."""

    def write(self, data: bytes, /) -> int: ...


def is_jsonl(path: str | Path) -> bool:
    """Whether ``path`` names JSON Lines, compressed or not (``x.jsonl``, ``x.jsonl.gz``, ``x.jsonl.zst``)."""
    suffixes = Path(path).suffixes
    if suffixes and suffixes[-1] in COMPRESSED:
        suffixes = suffixes[:-1]
    return bool(suffixes) and suffixes[-1] in JSONL


@contextmanager
def open_binary(path: str | Path) -> Iterator[Readable]:
    """``path``'s bytes, decompressed as its suffix says (``.gz``: gzip; ``.zst``: Zstandard)."""
    suffix = Path(path).suffix
    if suffix == ".gz":
        with gzip.open(path, "rb") as stream:
            yield stream
    elif suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise ValueError(
                f"--data {path}: reading .zst needs the zstandard package: pip install 'tlm-train[zstd]'"
            ) from None
        with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as stream:
            yield stream
    else:
        with open(path, "rb") as stream:
            yield stream


def _text_chunks(stream: Readable) -> Iterator[str]:
    # UTF-8 decoded as it comes; a character split between two reads is decoded whole. Bytes that are not
    # UTF-8 become U+FFFD, as the text of a plain file always has.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while data := stream.read(_CHUNK):
        if text := decoder.decode(data):
            yield text
    if tail := decoder.decode(b"", final=True):
        yield tail


def _jsonl_texts(path: str | Path, stream: Readable, text_field: str) -> Iterator[str]:
    lines = io.TextIOWrapper(stream, encoding="utf-8", newline="\n")  # type: ignore[type-var]
    number = 0
    try:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"--data {path} line {number}: not JSON ({err.msg})") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"--data {path} line {number}: no text field {text_field!r} (got {keys}); name it with --text-field"
                )
            yield text
    except UnicodeDecodeError as err:
        raise ValueError(f"--data {path} after line {number}: not UTF-8 ({err.reason})") from None


def documents(path: str | Path, text_field: str = "text") -> Iterator[Iterable[str]]:
    """Each document of ``path`` as an iterable of text pieces: one for a text file (in chunks), one per line
    of JSON Lines (its ``text_field``). Each document must be consumed before the next is asked for."""
    with open_binary(path) as stream:
        if is_jsonl(path):
            for text in _jsonl_texts(path, stream, text_field):
                yield (text,)
        else:
            yield _text_chunks(stream)


def write_corpus(
    sources: Iterable[str | Path],
    sink: Writable,
    *,
    separator: str,
    text_field: str = "text",
    extra: Iterable[str] = (),
) -> int:
    """Write every document of ``sources`` (then the ``extra`` texts) to ``sink`` as UTF-8, ``separator`` between
    two documents; returns the number of documents."""
    count = 0

    def put(pieces: Iterable[str]) -> None:
        nonlocal count
        if count:
            sink.write(separator.encode("utf-8"))
        for piece in pieces:
            sink.write(piece.encode("utf-8"))
        count += 1

    for source in sources:
        for document in documents(source, text_field):
            put(document)
    for text in extra:
        put((text,))
    return count
