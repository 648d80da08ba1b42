"""The documents of ``--data`` files, read as streams: plain text (one document per file), JSON Lines (one
document per line, its text in a named field) and either compressed with gzip (``.gz``) or Zstandard (``.zst``,
with the optional ``zstandard`` package: ``pip install 'tlm-train[zstd]'``).

The kind comes from the name: ``corpus.jsonl.zst`` is JSON Lines in Zstandard, ``book.txt.gz`` (or ``book.gz``)
gzip'd text, ``data.v2.jsonl`` JSON Lines (the last suffix before any compression one decides). Nothing is read
whole: a text file comes in chunks and JSON Lines line by line, so a corpus larger than memory goes through
:func:`write_corpus` into one file that the tokenizer trains on and encodes.

Every file is untrusted. Anything but a regular file (a folder, ``/dev/zero``, a FIFO) is refused on the very
handle that is then read; compressed data that is truncated, corrupt or not of its suffix's kind, and plain data
that is in fact compressed, is refused naming the file (``ValueError``); one JSON Lines record may hold at most
:data:`MAX_RECORD_BYTES`, refused before more than that is held; and :func:`write_corpus` stops at ``max_bytes``
of text written, before the disk fills.
"""

import codecs
import gzip
import io
import json
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, runtime_checkable

from tlm_core.atomic import open_input

COMPRESSED = (".gz", ".zst")
JSONL = (".jsonl",)
#: The most bytes one JSON Lines record (one line, decompressed) may hold; a longer one is refused as soon as
#: this much of it was read, so a record of any size costs at most this much memory.
MAX_RECORD_BYTES = 64 << 20
_CHUNK = 1 << 20
_GZIP_MAGIC, _ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"


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


@runtime_checkable
class _SeekableReader(Protocol):
    """What :func:`_zstd_check` walks: a file opened for reading bytes, or an ``io.BytesIO``."""

    def read(self, size: int = -1, /) -> bytes: ...

    def seek(self, offset: int, whence: int = 0, /) -> int: ...


class _Checked(io.BufferedIOBase):
    """A decompressing stream whose failures (truncated, corrupt, not of its kind) are a ``ValueError``
    naming the file. A readable binary stream (``io.BufferedIOBase``), so ``io.TextIOWrapper`` takes it too."""

    def __init__(self, path: str | Path, kind: str, stream: Readable, errors: tuple[type[BaseException], ...]):
        super().__init__()
        self.path, self.kind, self.stream, self.errors = path, kind, stream, errors

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1, /) -> bytes:
        try:
            return self.stream.read(-1 if size is None else size)
        except EOFError:
            raise ValueError(f"--data {self.path}: truncated {self.kind} data (it ends mid-stream)") from None
        except self.errors as err:
            raise ValueError(f"--data {self.path}: not readable as {self.kind} data ({err})") from None

    def read1(self, size: int = -1, /) -> bytes:
        return self.read(size)


def _zstd_check(raw: _SeekableReader, path: str | Path) -> None:
    """Walk the Zstandard frames of ``raw`` (block headers only; the data is skipped, not decompressed) and
    refuse a file that is not Zstandard or ends inside a frame: the decompressor itself reports neither, it
    just stops. Leaves ``raw`` at its start."""

    def take(n: int, what: str) -> bytes:
        data = raw.read(n)
        if len(data) != n:
            raise ValueError(f"--data {path}: truncated Zstandard data (it ends inside {what})")
        return data

    def skip(n: int, what: str) -> None:
        if raw.seek(n, 1) > size:
            raise ValueError(f"--data {path}: truncated Zstandard data (it ends inside {what})")

    size = raw.seek(0, 2)
    raw.seek(0)
    frames = 0
    while magic := raw.read(4):
        number = int.from_bytes(magic, "little")
        if frames and len(magic) < 4:
            raise ValueError(f"--data {path}: truncated Zstandard data (it ends inside a frame's magic number)")
        if 0x184D2A50 <= number <= 0x184D2A5F and len(magic) == 4:  # a skippable frame: 4-byte size, then data
            skip(int.from_bytes(take(4, "a skippable frame"), "little"), "a skippable frame")
        elif magic == _ZSTD_MAGIC:
            descriptor = take(1, "a frame header")[0]
            single_segment = descriptor >> 5 & 1
            header = (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 3]
            header += (single_segment, 2, 4, 8)[descriptor >> 6]
            take(header, "a frame header")
            last = False
            while not last:
                block = int.from_bytes(take(3, "a block header"), "little")
                last, kind, length = bool(block & 1), block >> 1 & 3, block >> 3
                if kind == 3:
                    raise ValueError(f"--data {path}: not readable as Zstandard data (a reserved block type)")
                skip(1 if kind == 1 else length, "a block")
            if descriptor >> 2 & 1:
                take(4, "a frame checksum")
        elif frames == 0:
            raise ValueError(f"--data {path}: not Zstandard data (it starts with {magic!r}, not the Zstandard magic)")
        else:
            raise ValueError(f"--data {path}: not readable as Zstandard data (what follows frame {frames} is no frame)")
        frames += 1
    raw.seek(0)


@contextmanager
def open_binary(path: str | Path) -> Iterator[Readable]:
    """``path``'s bytes, decompressed as its suffix says (``.gz``: gzip; ``.zst``: Zstandard). A path that is not
    a regular file, compressed data that is truncated, corrupt or of another kind, and an uncompressed name
    whose data is gzip or Zstandard raise ``ValueError`` naming the file (a missing one ``FileNotFoundError``)."""
    suffix = Path(path).suffix
    with open_input(path, "--data") as raw:
        if suffix == ".gz":
            if (head := raw.read(2)) and head != _GZIP_MAGIC:
                raise ValueError(f"--data {path}: not gzip data (it starts with {head!r}, not the gzip magic)")
            raw.seek(0)
            with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                yield _Checked(path, "gzip", stream, (gzip.BadGzipFile, zlib.error))
        elif suffix == ".zst":
            try:
                import zstandard
            except ImportError:
                raise ValueError(
                    f"--data {path}: reading .zst needs the zstandard package: pip install 'tlm-train[zstd]'"
                ) from None
            _zstd_check(raw, path)
            with zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False) as stream:
                yield _Checked(path, "Zstandard", stream, (zstandard.ZstdError,))
        else:
            head = raw.read(4)
            for magic, kind, name in ((_GZIP_MAGIC, "gzip", ".gz"), (_ZSTD_MAGIC, "Zstandard", ".zst")):
                if head.startswith(magic):
                    raise ValueError(f"--data {path}: holds {kind}-compressed data; name it with {name} at the end")
            raw.seek(0)
            yield raw


def _text_chunks(stream: Readable) -> Iterator[str]:
    # UTF-8 decoded as it comes; a character split between two reads is decoded whole. Bytes that are not
    # UTF-8 become U+FFFD, as the text of a plain file always has.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while data := stream.read(_CHUNK):
        if text := decoder.decode(data):
            yield text
    if tail := decoder.decode(b"", final=True):
        yield tail


def _lines(path: str | Path, stream: Readable, limit: int) -> Iterator[tuple[int, bytes]]:
    """The numbered lines of ``stream`` (without their ``\\n``), read in chunks: a line longer than ``limit``
    bytes raises ``ValueError`` once ``limit`` bytes of it were read, so no line is held beyond that."""
    number, pending, held = 1, [], 0
    while data := stream.read(_CHUNK):
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if held + end - start > limit:
                break
            pending.append(data[start:end])
            yield number, b"".join(pending)
            number, pending, held, start = number + 1, [], 0, end + 1
        pending.append(data[start:])
        held += len(data) - start
        if held > limit:
            raise ValueError(
                f"--data {path} line {number}: a record over {limit:,} bytes, the most one JSON Lines record may "
                "hold (tlm_train.sources.MAX_RECORD_BYTES); split it into several records"
            )
    if held:
        yield number, b"".join(pending)


def json_lines(path: str | Path, stream: Readable, limit: int = MAX_RECORD_BYTES) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line of the JSON Lines ``stream`` read from ``path``, blank ones included:
    a line that is not UTF-8, or longer than ``limit`` bytes, raises ``ValueError`` naming the file and line,
    the long one before more than ``limit`` bytes of it are held."""
    for number, raw in _lines(path, stream, limit):
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"--data {path} line {number}: not UTF-8 ({err.reason} at byte {err.start})") from None


def _jsonl_texts(path: str | Path, stream: Readable, text_field: str, limit: int) -> Iterator[str]:
    for number, line in json_lines(path, stream, limit):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--data {path} line {number}: not JSON ({err.msg})") from None
        except RecursionError:
            raise ValueError(f"--data {path} line {number}: not JSON (nested too deeply)") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"--data {path} line {number}: no text field {text_field!r} (got {keys}); name it with --text-field"
            )
        yield text


def documents(
    path: str | Path, text_field: str = "text", *, max_record_bytes: int = MAX_RECORD_BYTES
) -> Iterator[Iterable[str]]:
    """Each document of ``path`` as an iterable of text pieces: one for a text file (in chunks), one per line
    of JSON Lines (its ``text_field``; blank lines are skipped, and counted in the line numbers of errors). Each
    document must be consumed before the next is asked for. A JSON Lines record over ``max_record_bytes`` is
    refused (``ValueError``) once that much of it was read."""
    with open_binary(path) as stream:
        if is_jsonl(path):
            for text in _jsonl_texts(path, stream, text_field, max_record_bytes):
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
    max_bytes: int | None = None,
    flag: str = "--data",
) -> int:
    """Write every document of ``sources`` (then the ``extra`` texts) to ``sink`` as UTF-8, ``separator`` between
    two documents; returns the number of documents. Writing more than ``max_bytes`` in all raises ``ValueError``
    naming the file being read (as ``flag FILE``), before the piece that would pass the limit is written."""
    count = written = 0

    def write(data: bytes) -> None:
        nonlocal written
        if max_bytes is not None and written + len(data) > max_bytes:
            raise ValueError(
                f"{where}: the corpus passed --max-data-bytes {max_bytes:,} (text from all {flag} files, "
                f"decompressed); raise --max-data-bytes if the disk has room, or give less data"
            )
        sink.write(data)
        written += len(data)

    def put(pieces: Iterable[str]) -> None:
        nonlocal count
        if count:
            write(separator.encode("utf-8"))
        for piece in pieces:
            write(piece.encode("utf-8"))
        count += 1

    for source in sources:
        where = f"{flag} {source}"
        for document in documents(source, text_field):
            put(document)
    where = "the default corpus"
    for text in extra:
        put((text,))
    return count
