"""``tokenizer train|encode`` (cli.py): in-process through ``main`` and ``register``; user errors also through
``python -m tlm_tokenizer`` (test___main__.py runs the module itself)."""

import argparse
import json

import numpy as np
import pytest
from processes import run_module

from tlm_tokenizer import Tokenizer
from tlm_tokenizer.cli import main, register


@pytest.fixture
def corpus(tmp_path, english_text):
    path = tmp_path / "corpus.txt"
    path.write_bytes((english_text[:20_000] + "<|endoftext|>" + english_text[20_000:40_000]).encode())
    return path


def test_train_then_encode_in_process(corpus, tmp_path, capsys):
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "400",
                 "--special-token", "<|endoftext|>", "--out", str(out), "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out) == {"out": str(out), "vocab_size": 400, "merges": 143}
    tokenizer = Tokenizer.load(out)
    assert tokenizer.special_tokens == ["<|endoftext|>"]
    ids_path = tmp_path / "ids.bin"
    assert main(["tokenizer", "encode", "--tokenizer", str(out), "--input", str(corpus), "--out", str(ids_path)]) == 0
    assert "as raw little-endian uint16" in capsys.readouterr().out
    text = corpus.read_bytes().decode()
    assert np.fromfile(ids_path, dtype="<u2").tolist() == tokenizer.encode(text)


def test_register_plugs_into_another_parser(corpus, tmp_path):
    # What tlm's main does with every "tlm.cli" entry point: hand it the subparsers object.
    parser = argparse.ArgumentParser(prog="tlm")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300",
                              "--out", str(tmp_path / "t"), "--quiet"])  # fmt: skip
    assert args.handler(args) == 0
    assert len(Tokenizer.load(tmp_path / "t").vocab) == 300


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--input", "{missing}", "--vocab-size", "300", "--out", "{tmp}/t"], "--input: expected a text file"),
        (
            ["train", "--input", "{corpus}", "--vocab-size", "100", "--out", "{tmp}/t"],
            "vocab_size must be at least 256",
        ),
        (
            ["train", "--input", "{corpus}", "--vocab-size", "300", "--out", "{corpus}"],
            "must be a folder (or not exist",
        ),
        (["train", "--input", "{corpus}", "--vocab-size", "300", "--out", "{tmp}"], "which holds binary.txt, corpus"),
        (["train", "--input", "{binary}", "--vocab-size", "300", "--out", "{tmp}/t"], "can't decode byte 0xff"),
        (["encode", "--tokenizer", "{tmp}/none", "--input", "{corpus}", "--out", "{tmp}/x"], "a tokenizer folder, got"),
        (["encode", "--tokenizer", "{tmp}", "--input", "{corpus}", "--out", "{tmp}/x"], "must hold tokenizer.json"),
        (["encode", "--tokenizer", "{tmp}", "--input", "{missing}", "--out", "{tmp}/x"], "--input: expected a text"),
    ],
)
def test_user_errors_are_one_line_exit_2(corpus, tmp_path, capsys, args, message):
    (tmp_path / "binary.txt").write_bytes(b"abc \xff\xfe")
    places = {"missing": tmp_path / "absent.txt", "tmp": tmp_path, "corpus": corpus, "binary": tmp_path / "binary.txt"}
    argv = ["tokenizer", *(arg.format(**places) for arg in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tlm: error: ") and message in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.txt", "corpus.txt"], "a user's folder changed"
    done = run_module(*argv)
    assert done.returncode == 2 and done.stderr == err and "Traceback" not in done.stderr
