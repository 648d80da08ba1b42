"""``--data`` documents from text and JSON Lines files, plain or compressed (gzip, Zstandard), read as streams."""

import gzip
import json

import numpy as np
import pytest

from tlm_tokenizer import Tokenizer, train_bpe
from tlm_train import RunDir, TrainConfig, default_corpus
from tlm_train.data import prepare_data
from tlm_train.recipe import data_settings
from tlm_train.sources import documents, write_corpus

zstandard = pytest.importorskip("zstandard", reason="the zstd extra (zstandard) is not installed")

DOCS = ["The first document.\nTwo lines.", "ünïcödé, and a split character: 日本語", "", "last"]


def _jsonl(docs, field="text") -> bytes:
    return "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)).encode()


@pytest.fixture
def files(tmp_path):
    raw = _jsonl(DOCS)
    paths = {
        "jsonl": tmp_path / "c.jsonl",
        "jsonl.gz": tmp_path / "c.jsonl.gz",
        "jsonl.zst": tmp_path / "c.jsonl.zst",
        "txt.gz": tmp_path / "book.txt.gz",
        "zst": tmp_path / "book.zst",
    }
    paths["jsonl"].write_bytes(raw)
    paths["jsonl.gz"].write_bytes(gzip.compress(raw))  # real files, compressed by the format's own library
    paths["jsonl.zst"].write_bytes(zstandard.ZstdCompressor().compress(raw))
    paths["txt.gz"].write_bytes(gzip.compress(DOCS[1].encode()))
    paths["zst"].write_bytes(zstandard.ZstdCompressor().compress(DOCS[1].encode()))
    return paths


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "jsonl.zst"])
def test_json_lines_give_one_document_per_line_plain_or_compressed(files, kind):
    assert ["".join(d) for d in documents(files[kind])] == DOCS


@pytest.mark.parametrize("kind", ["txt.gz", "zst"])
def test_compressed_text_is_one_document(files, kind):
    assert ["".join(d) for d in documents(files[kind])] == [DOCS[1]]


@pytest.mark.parametrize(
    ("name", "jsonl"),
    [
        ("data.v2.jsonl", True),  # the last suffix decides, not the first
        ("data.v2.jsonl.gz", True),
        ("c.jsonl.zst", True),
        ("data.jsonl.v2", False),
        ("notes.jsonl.txt", False),
        ("c.json", False),
        ("c.gz", False),
        ("jsonl", False),
        (".jsonl", False),  # a hidden file with no suffix
        ("c.txt.zst", False),
    ],
)
def test_the_kind_comes_from_the_last_suffix_before_compression(name, jsonl):
    from tlm_train.sources import is_jsonl

    assert is_jsonl(name) is jsonl


def test_blank_and_whitespace_lines_of_json_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "data.v2.jsonl"
    path.write_bytes(b'\n{"text": "a"}\n \t \r\n\n{"text": "b"}\r\n\n\nnot json\n')
    got = documents(path)
    assert ["".join(next(got)), "".join(next(got))] == ["a", "b"]
    with pytest.raises(ValueError, match=r"data\.v2\.jsonl line 8: not JSON"):
        next(got)


def test_another_text_field_and_the_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(_jsonl(["a", "b"], field="content") + b"{not json\n")
    got = documents(path, text_field="content")
    assert ["".join(next(got)), "".join(next(got))] == ["a", "b"]  # streamed: read before the bad line is
    with pytest.raises(ValueError, match=r"c\.jsonl line 3: not JSON"):
        next(got)
    with pytest.raises(ValueError, match=r"c\.jsonl line 1: no text field 'text' \(got \['content', 'id'\]\); name it"):
        next(documents(path))


def test_a_run_trains_on_the_documents_of_a_compressed_jsonl_joined_by_end_of_text(tmp_path):
    # The tokens equal the given tokenizer's encoding of the documents joined as a text file would be.
    docs = [default_corpus()[i : i + 3000] for i in range(0, 30_000, 3000)]
    source = tmp_path / "corpus.jsonl.zst"
    source.write_bytes(zstandard.ZstdCompressor().compress(_jsonl(docs)))
    corpus = tmp_path / "joined.txt"
    corpus.write_text("<|endoftext|>".join(docs), encoding="utf-8")
    tokenizer = Tokenizer(*train_bpe(str(corpus), 300, ["<|endoftext|>"]), ["<|endoftext|>"])
    config = TrainConfig(data=[str(source)], out_dir=str(tmp_path / "run"))
    data = prepare_data(data_settings(config), RunDir(tmp_path / "run"), tokenizer=tokenizer)
    assert np.concatenate([data.train, data.val]).tolist() == tokenizer.encode(corpus.read_text(encoding="utf-8"))
    assert not [p for p in (tmp_path / "run").iterdir() if "corpus" in p.name]  # the temporary is gone


def test_write_corpus_puts_the_separator_between_documents_only(tmp_path, files):
    out = tmp_path / "out.txt"
    with out.open("wb") as sink:
        assert write_corpus([files["jsonl.gz"], files["txt.gz"]], sink, separator="|") == 5
    assert out.read_text(encoding="utf-8") == "|".join([*DOCS, DOCS[1]])


def test_zst_without_zstandard_is_a_one_line_error(files, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now raises ImportError
    with pytest.raises(ValueError, match=r"reading \.zst needs the zstandard package: pip install 'tlm-train\[zstd\]'"):
        next(documents(files["zst"]))


def test_write_corpus_writes_the_extra_texts_after_the_documents(tmp_path, files):
    out = tmp_path / "out.txt"
    with out.open("wb") as sink:
        assert write_corpus([files["jsonl"]], sink, separator="|", extra=["more", "the end"]) == 6
    assert out.read_text(encoding="utf-8") == "|".join([*DOCS, "more", "the end"])


# --- Hostile files: every failure is a ValueError naming the file, never a traceback of the decompressor ---------

TEXT = b"".join(b'{"text": "record %d, some words to compress"}\n' % i for i in range(3000))


def _zst(data: bytes, **options) -> bytes:
    return zstandard.ZstdCompressor(**options).compress(data)


HOSTILE = {
    # name: (bytes, the fragment of the message)
    "cut.jsonl.gz": (gzip.compress(TEXT)[:-100], "truncated gzip data"),
    "cut-header.txt.gz": (gzip.compress(TEXT)[:5], "truncated gzip data"),
    "plain.gz": (TEXT, "not gzip data (it starts with b'{\"'"),
    "bad-crc.txt.gz": (gzip.compress(TEXT)[:-8] + b"\0" * 8, "not readable as gzip data (CRC check failed"),
    "bad-deflate.txt.gz": (gzip.compress(TEXT)[:10] + b"\xff" * 50, "not readable as gzip data"),
    "plain.zst": (TEXT, "not Zstandard data (it starts with b'{\"te'"),
    "cut-block.jsonl.zst": (_zst(TEXT)[:200], "truncated Zstandard data (it ends inside a block)"),
    "cut-header.zst": (_zst(TEXT)[:5], "truncated Zstandard data (it ends inside a frame header)"),
    "cut-checksum.zst": (_zst(TEXT, write_checksum=True)[:-2], "it ends inside a frame checksum"),
    "cut-magic.zst": (_zst(TEXT) + b"\x28\xb5", "truncated Zstandard data (it ends inside a frame's magic number)"),
    "junk-after.zst": (_zst(TEXT) + b"junk", "what follows frame 1 is no frame"),
    "bad-checksum.zst": (_zst(TEXT, write_checksum=True)[:-4] + b"\0" * 4, "doesn't match checksum"),
    "gzip-named.txt": (gzip.compress(TEXT), "holds gzip-compressed data; name it with .gz at the end"),
    "zstd-named.jsonl": (_zst(TEXT), "holds Zstandard-compressed data; name it with .zst at the end"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_bad_compressed_data_is_a_value_error_naming_the_file(tmp_path, name):
    data, fragment = HOSTILE[name]
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"^--data \S+") as info:
        for document in documents(path):
            for _ in document:
                pass
    assert str(info.value).startswith(f"--data {path}: ") and fragment in str(info.value), str(info.value)


def test_every_frame_of_a_multi_frame_zst_is_read(tmp_path):
    # What pzstd and `cat a.zst b.zst` make: frames one after another, and a skippable frame between.
    path = tmp_path / "frames.jsonl.zst"
    skippable = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    path.write_bytes(_zst(_jsonl(DOCS[:2])) + skippable + _zst(_jsonl(DOCS[2:]), write_checksum=True))
    assert ["".join(d) for d in documents(path)] == DOCS


@pytest.mark.parametrize("kind", ["device", "fifo", "folder"])
def test_what_is_not_a_regular_file_is_refused_naming_it(tmp_path, kind):
    import os

    from tlm_train.data import check_data_paths

    if kind == "device":
        path, what = "/dev/zero", "a character device"
        if not os.path.exists(path):
            pytest.skip("no /dev/zero on this platform")
    elif kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("no FIFOs on this platform")
        path, what = str(tmp_path / "pipe.txt"), "a FIFO"
        os.mkfifo(path)  # nothing writes to it: a read would block forever
    else:
        path, what = str(tmp_path), "a folder"
    for check in (lambda: check_data_paths([path]), lambda: next(documents(path))):
        with pytest.raises(ValueError, match=rf"^--data {path}: {what}.*, expected a regular file$"):
            check()


def test_the_handle_checked_is_the_one_read_while_another_process_replaces_the_file(tmp_path):
    # The check is made on the open descriptor: once open, a rename of something else over the name (by
    # another process) changes nothing that is read; the old file's bytes come whole.
    import subprocess
    import sys

    path = tmp_path / "c.jsonl"
    path.write_bytes(_jsonl(["old one", "old two"]))
    other = tmp_path / "other.jsonl"
    other.write_bytes(_jsonl(["new"]))
    got = documents(path)
    first = "".join(next(got))  # open and checked
    subprocess.run([sys.executable, "-c", f"import os; os.replace({str(other)!r}, {str(path)!r})"], check=True)
    assert [first, *("".join(d) for d in got)] == ["old one", "old two"]
    assert ["".join(d) for d in documents(path)] == ["new"]


# --- Bounds: one record, and the whole corpus --------------------------------------------------------------------


def _gzip_bomb(path, size: int, prefix: bytes) -> None:
    """A gzip file of ``prefix`` then ``size`` bytes of "a" and no newline, written in ~1 KB per MiB: one 1 MiB
    deflate block repeated (each full-flushed, so no block refers to another). The trailer's CRC is not
    computed (0): the reader must refuse long before it gets there."""
    import struct
    import zlib

    mib = 1 << 20
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = deflate.compress(prefix) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(b"a" * mib) + deflate.flush(zlib.Z_FULL_FLUSH)
    with open(path, "wb") as out:
        out.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + head)
        for _ in range(size // mib):
            out.write(block)
        out.write(deflate.flush(zlib.Z_FINISH) + struct.pack("<II", 0, (size + len(prefix)) & 0xFFFFFFFF))


def test_a_record_that_decompresses_to_2_gb_is_refused_holding_no_more_than_the_limit(tmp_path):
    import tracemalloc

    from tlm_train.sources import MAX_RECORD_BYTES

    path = tmp_path / "bomb.jsonl.gz"
    _gzip_bomb(path, 2 << 30, prefix=b'{"text": "first"}\n\n{"text": "')  # line 3 never ends
    assert path.stat().st_size < 4 << 20  # cheap to build: about 2 MB on disk
    got = documents(path)
    assert "".join(next(got)) == "first"
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as info:
            next(got)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert MAX_RECORD_BYTES == 64 * 2**20  # the limit the README documents
    assert str(info.value) == (
        f"--data {path} line 3: a record over {MAX_RECORD_BYTES:,} bytes, the most one JSON Lines record may hold "
        "(tlm_train.sources.MAX_RECORD_BYTES); split it into several records"
    )
    assert peak < MAX_RECORD_BYTES + (8 << 20)  # the limit and a read or two, not the 2 GB line


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_records_up_to_the_limit_are_read_whatever_the_reads_and_one_byte_more_is_refused(tmp_path, monkeypatch, chunk):
    import tlm_train.sources as sources

    monkeypatch.setattr(sources, "_CHUNK", chunk)  # lines split across reads in every way
    records = [json.dumps({"text": "x" * n}) for n in (0, 1, 8, 9)]  # 12 to 21 bytes each
    path = tmp_path / "c.jsonl"
    path.write_text("\n\n".join(records) + "\n   \n", encoding="utf-8")
    assert ["".join(d) for d in documents(path, max_record_bytes=21)] == ["", "x", "x" * 8, "x" * 9]
    with pytest.raises(ValueError, match=r"c\.jsonl line 7: a record over 20 bytes"):
        list(documents(path, max_record_bytes=20))  # line 7: the blank lines count


def test_write_corpus_stops_before_passing_max_bytes_naming_the_file(tmp_path, files):
    whole = tmp_path / "whole.txt"
    with whole.open("wb") as sink:
        write_corpus([files["jsonl.gz"], files["zst"]], sink, separator="|")
    size = whole.stat().st_size
    out = tmp_path / "out.txt"
    with out.open("wb") as sink:
        assert write_corpus([files["jsonl.gz"], files["zst"]], sink, separator="|", max_bytes=size) == 5
    with (
        out.open("wb") as sink,
        pytest.raises(ValueError, match=rf"^--data {files['zst']}: the corpus passed --max-data-bytes {size - 1:,} "),
    ):
        write_corpus([files["jsonl.gz"], files["zst"]], sink, separator="|", max_bytes=size - 1)
    assert out.read_bytes() == whole.read_bytes()[: len(out.read_bytes())] and out.stat().st_size < size


def test_a_run_refuses_data_past_max_data_bytes_before_writing_its_data(tmp_path, files):
    run = RunDir(tmp_path / "run")
    config = TrainConfig(data=[str(files["jsonl"])], out_dir=str(run.path), max_data_bytes=10)
    with pytest.raises(ValueError, match=r"c\.jsonl: the corpus passed --max-data-bytes 10 "):
        prepare_data(data_settings(config), run)
    assert [p.name for p in run.path.iterdir()] == []  # no data, no tokenizer, no temporary corpus


def test_chat_data_is_read_through_the_same_checked_bounded_reader(tmp_path):
    from tlm_train.chat_data import conversations, is_chat_file
    from tlm_train.sources import MAX_RECORD_BYTES

    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = tmp_path / "chat.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n" + json.dumps(chat).encode() + b"\n"))  # compressed, a blank line first
    assert is_chat_file(path) and [n for n, _ in conversations(path)] == [2]

    bomb = tmp_path / "bomb.jsonl.gz"
    _gzip_bomb(bomb, 2 * MAX_RECORD_BYTES, prefix=json.dumps(chat).encode() + b'\n{"messages": "')
    assert is_chat_file(bomb)  # the first record decides; the second is the bomb
    with pytest.raises(ValueError, match=rf"^--data {bomb} line 2: a record over {MAX_RECORD_BYTES:,} bytes"):
        list(conversations(bomb))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(json.dumps(chat).encode() * 50)[:-30])
    with pytest.raises(ValueError, match=rf"^--data {cut}: truncated gzip data"):
        list(conversations(cut))


def test_json_lines_gives_each_line_without_its_newline_and_refuses_json_nested_too_deeply(tmp_path):
    import io

    from tlm_train.sources import json_lines

    data = b'{"text": "a"}\n\n  \n{"text": "b"}\r\nlast'
    assert list(json_lines("x", io.BytesIO(data))) == [(1, '{"text": "a"}'), (2, ""), (3, "  "), (4, '{"text": "b"}\r'),
                                                       (5, "last")]  # fmt: skip
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "ok"}\n{"text": ' + "[" * 100_000 + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"deep\.jsonl line 2: not JSON \(nested too deeply\)"):
        list(documents(path))


def test_a_decompressed_stream_read_whole_is_the_whole_data(files):
    from tlm_train.sources import open_binary

    for kind in ("jsonl.gz", "jsonl.zst"):
        with open_binary(files[kind]) as stream:
            assert stream.read() == _jsonl(DOCS)


def _frame(descriptor: int, did: int, fcs: int, checksum: bool) -> bytes:
    """A Zstandard frame made by hand (RFC 8878 3.1.1): the header fields the descriptor announces, then one
    raw block holding b"hello" that is also the last, then the 4-byte checksum when announced."""
    single = descriptor >> 5 & 1
    header = bytes([descriptor]) + (b"" if single else b"\x00")  # window descriptor: a 1 KB window
    header += did.to_bytes((0, 1, 2, 4)[descriptor & 3], "little")
    size = (single, 2, 4, 8)[descriptor >> 6]
    header += fcs.to_bytes(size, "little") if size else b""
    block = (1 | 0 << 1 | 5 << 3).to_bytes(3, "little") + b"hello"  # last, raw, 5 bytes
    return b"\x28\xb5\x2f\xfd" + header + block + (b"\0\0\0\0" if checksum else b"")


@pytest.mark.parametrize("did_flag", [0, 1, 2, 3])
@pytest.mark.parametrize("fcs_flag", [0, 1, 2, 3])
@pytest.mark.parametrize("single", [0, 1])
def test_every_zstandard_frame_header_layout_is_walked_and_each_truncation_found(tmp_path, did_flag, fcs_flag, single):
    import io

    from tlm_train.sources import _zstd_check

    descriptor = fcs_flag << 6 | single << 5 | did_flag
    fcs = 5 if fcs_flag != 1 else 0  # the 2-byte field holds the size less 256: 5 is not representable
    frame = _frame(descriptor, did=7 if did_flag else 0, fcs=fcs, checksum=False)
    _zstd_check(io.BytesIO(frame), "x")  # the whole frame: no complaint
    if did_flag == 0 and fcs_flag != 1:  # what zstandard itself decodes (no dictionary, the true content size)
        assert zstandard.ZstdDecompressor().stream_reader(io.BytesIO(frame)).read() == b"hello"
    for end in range(4, len(frame)):  # past the magic: a shorter file is "not Zstandard data"
        with pytest.raises(ValueError, match="truncated Zstandard data"):
            _zstd_check(io.BytesIO(frame[:end]), "x")
