"""``python -m tlm_tokenizer`` (__main__.py): the tokenizer commands without the tlm command, exit codes included."""

import pytest
from processes import run_module


def test_the_module_trains_and_exits_0(tmp_path, english_text):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(english_text[:20_000], encoding="utf-8")
    done = run_module("tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "t"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path / 't'}: 300 tokens, 44 merges")


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--input", "x", "--vocab-size", "many", "--out", "d"],
        ["train", "--input", "x", "--vocab-size", "-5", "--out", "d"],
        ["encode", "--tokenizer", "d", "--input", "x"],
        ["encode", "--tokenizer", "d", "--input", "x", "--out", "y"],  # a user error: no such file
        ["nonsense"],
        [],
    ],
)
def test_errors_exit_2_in_one_line_without_traceback(args):
    done = run_module("tokenizer", *args)
    assert done.returncode == 2 and "error:" in done.stderr and "Traceback" not in done.stderr
