"""``--data`` documents from text and JSON Lines files, plain or compressed (gzip, Zstandard), read as streams."""

import gzip
import json

import numpy as np
import pytest

from tlm_tokenizer import Tokenizer, train_bpe
from tlm_train import RunDir, TrainConfig, default_corpus
from tlm_train.data import prepare_data
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
    data = prepare_data(config, RunDir(tmp_path / "run"), tokenizer=tokenizer)
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
