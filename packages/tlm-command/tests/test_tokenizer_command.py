"""``tlm tokenizer train|encode``: in-process and as ``python -m tlm``; an output never overwrites an input."""

import json

import numpy as np
import pytest

from tlm_command.main import main
from tlm_tokenizer import Tokenizer


@pytest.fixture
def text(tmp_path, corpus):
    path = tmp_path / "corpus.txt"
    body = corpus.read_text(encoding="utf-8")
    path.write_text(body[:20_000] + "<|endoftext|>" + body[20_000:40_000], encoding="utf-8")
    return path


def test_train_then_encode_in_process(text, tmp_path, capsys):
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(text), "--vocab-size", "400",
                 "--special-token", "<|endoftext|>", "--out", str(out), "--json", "--quiet"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert summary["out"] == str(out) and summary["vocab_size"] == 400
    tokenizer = Tokenizer.load(out)
    assert tokenizer.special_tokens == ["<|endoftext|>"]
    ids_path = tmp_path / "ids.bin"
    assert main(["tokenizer", "encode", "--tokenizer", str(out), "--input", str(text), "--out", str(ids_path)]) == 0
    assert "as raw little-endian uint16" in capsys.readouterr().out
    expected = tokenizer.encode(text.read_text(encoding="utf-8"))
    assert np.fromfile(ids_path, dtype="<u2").tolist() == expected
    again = tmp_path / "again.bin"
    argv = ["tokenizer", "encode", "--tokenizer", str(out), "--input", str(text), "--out", str(again), "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == {"out": str(again), "tokens": len(expected), "dtype": "uint16"}


@pytest.mark.slow  # a new interpreter importing torch
def test_the_command_runs_as_python_dash_m_tlm(text, tmp_path, tlm):
    done = tlm("tokenizer", "train", "--input", text, "--vocab-size", 300, "--out", tmp_path / "t", "--quiet")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path / 't'}: 300 tokens")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--input", "{missing}", "--vocab-size", "300", "--out", "{tmp}/t"], "--input: expected a text file"),
        (["train", "--input", "{text}", "--vocab-size", "300", "--out", "{text}"], "would overwrite the input"),
        (["train", "--input", "{text}", "--vocab-size", "300", "--out", "{tmp}"], "would overwrite the input"),
        (
            ["train", "--input", "{binary}", "--vocab-size", "300", "--out", "{tmp}/t"],
            "{binary} is not UTF-8 text (invalid start byte at byte 4)",
        ),
        (["train", "--input", "{empty}", "--vocab-size", "300", "--out", "{tmp}/t"], "--input {empty} holds no pair"),
        (["train", "--input", "{text}", "--vocab-size", "300", "--out", "{tmp}/user"], "which holds notes.txt"),
        (["encode", "--tokenizer", "{tmp}/none", "--input", "{text}", "--out", "{tmp}/x"], "{tmp}/none"),
        (["encode", "--tokenizer", "{tmp}/tok", "--input", "{missing}", "--out", "{tmp}/x"], "--input: expected"),
        (["encode", "--tokenizer", "{tmp}/tok", "--input", "{text}", "--out", "{text}"], "would overwrite the input"),
        (["train", "--input", "/dev/zero", "--vocab-size", "300", "--out", "{tmp}/t"], "/dev/zero: a character"),
        (["encode", "--tokenizer", "{tmp}/tok", "--input", "{tmp}/user", "--out", "{tmp}/x"], "{tmp}/user: a folder"),
    ],
)
def test_user_errors_are_one_line_exit_2_and_inputs_survive(text, tmp_path, fails, capsys, args, message):
    (tmp_path / "binary.txt").write_bytes(b"abc \xff\xfe")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("a user's file")
    main(["tokenizer", "train", "--input", str(text), "--vocab-size", "300", "--out", str(tmp_path / "tok"), "--quiet"])
    capsys.readouterr()  # the summary of that training, before the failing call
    places = {"missing": tmp_path / "absent.txt", "tmp": tmp_path, "text": text, "binary": tmp_path / "binary.txt",
              "empty": tmp_path / "empty.txt"}  # fmt: skip
    before = text.read_bytes()
    fails(["tokenizer", *(arg.format(**places) for arg in args)], message.format(**places))
    assert text.read_bytes() == before  # an output equal to an input is refused before anything is written
    assert [p.name for p in (tmp_path / "user").iterdir()] == ["notes.txt"]  # a user's folder is not replaced


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--input", "x", "--vocab-size", "many", "--out", "d"], "--vocab-size: must be a positive integer"),
        (["train", "--input", "x", "--vocab-size", "-5", "--out", "d"], "must be a positive integer, got -5"),
        (["encode", "--tokenizer", "d", "--input", "x"], "the following arguments are required: --out"),
        (["nonsense"], "invalid choice: 'nonsense'"),
        ([], "the following arguments are required: {train,encode}"),
    ],
)
def test_usage_errors_exit_2_on_one_line(args, message, fails):
    # In-process: test_the_command_runs_as_python_dash_m_tlm and test_main.py run the real interpreter.
    fails(["tokenizer", *args], message)


#: Each subcommand's required arguments (never read: parsing stops before anything runs).
REQUIRED = {
    "train": ["--input", "x", "--out", "y", "--vocab-size", "300"],
    "encode": ["--tokenizer", "t", "--input", "x", "--out", "y"],
}


@pytest.mark.parametrize(
    ("command", "workers", "workers_help"),
    [("train", None, "pre-tokenisation processes (default: CPU count, at most 8)"), ("encode", 1, "processes")],
)
def test_the_run_flags_of_each_subcommand(command, workers, workers_help, capsys):
    from tlm_command.main import build_parser

    args = build_parser().parse_args(["tokenizer", command, *REQUIRED[command]])
    assert (args.workers, args.json, args.quiet) == (workers, False, False)
    with pytest.raises(SystemExit):
        main(["tokenizer", command, "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    for text in ("--workers N", workers_help, "--json print a JSON summary", "--quiet no progress bars"):
        assert text in shown, text


@pytest.mark.parametrize("command", ["train", "encode"])
def test_workers_must_be_a_positive_int(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["tokenizer", command, *REQUIRED[command], "--workers", "0"])
    assert exit_info.value.code == 2
    assert "argument --workers: must be a positive integer, got 0" in capsys.readouterr().err
