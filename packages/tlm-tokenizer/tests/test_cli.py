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
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "400", "--workers", "1",
                 "--special-token", "<|endoftext|>", "--out", str(out), "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out) == {"out": str(out), "vocab_size": 400, "merges": 143}
    tokenizer = Tokenizer.load(out)
    assert tokenizer.special_tokens == ["<|endoftext|>"]
    ids_path = tmp_path / "ids.bin"
    assert main(["tokenizer", "encode", "--tokenizer", str(out), "--input", str(corpus), "--out", str(ids_path),
                 "--workers", "2", "--quiet"]) == 0  # fmt: skip
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


def test_defaults():
    parser = argparse.ArgumentParser(prog="tlm")
    register(parser.add_subparsers(dest="command", required=True))
    train = parser.parse_args(["tokenizer", "train", "--input", "c", "--vocab-size", "300", "--out", "d"])
    assert (train.workers, train.special_token, train.json, train.quiet) == (None, None, False, False)
    encode = parser.parse_args(["tokenizer", "encode", "--tokenizer", "d", "--input", "c", "--out", "x"])
    assert (encode.workers, encode.json, encode.quiet) == (1, False, False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: tokenizer"),
        (["tokenizer"], "the following arguments are required: {train,encode}"),
        (["tokenizer", "encode", "--input", "x", "--out", "y"], "the following arguments are required: --tokenizer"),
        (["tokenizer", "encode", "--tokenizer", "d", "--out", "y"], "the following arguments are required: --input"),
        (
            ["tokenizer", "train", "--input", "x", "--vocab-size", "0", "--out", "d"],
            "expected a positive integer, got 0",
        ),
        (["tokenizer", "train", "--input", "x", "--vocab-size", "9", "--out", "d", "--workers", "0"], "got 0"),
    ],
)
def test_usage_errors_are_argparses_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "lines"),
    [
        (
            "train",
            [
                "Writes DIR/tokenizer.json (HF tokenizers' format) and DIR/tokenizer_config.json",
                "--input FILE",
                "UTF-8 training text",
                "--vocab-size N",
                "final vocabulary size, counting the 256 bytes and the special tokens",
                "--special-token TOKEN",
                "--out DIR",
                "--workers N",
                "pre-tokenisation processes (default: CPU count, at most 8)",
                "--json",
                "print a JSON summary",
                "no progress bars",
            ],
        ),
        (
            "encode",
            [
                "--tokenizer DIR",
                "a directory written by 'tokenizer train'",
                "--input FILE",
                "UTF-8 text to encode",
                "--out FILE",
                "token-id file to write",
                "--workers N",
                "processes (default 1)",
                "print a JSON summary",
                "no progress bar",
            ],
        ),
    ],
)
def test_help_describes_every_option(capsys, command, lines):
    with pytest.raises(SystemExit) as exited:
        main(["tokenizer", command, "--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines to the terminal's width
    assert all(line in shown for line in lines), [line for line in lines if line not in shown]


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["tokenizer", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "train train byte-level BPE on a UTF-8 text file" in shown
    assert "encode encode a UTF-8 text file to a flat token-id array" in shown
