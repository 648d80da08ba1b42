"""``tlm generate``: the library's tokens from every kind of checkpoint, text streamed as it comes, stop texts,
a window that slides past the context, and one-line errors."""

import io
import json
import os
import sys

import pytest
import torch

from tlm_command.main import main
from tlm_model import ModelConfig, TransformerLM, generate, load_model_file, save_model_file
from tlm_train import RunDir


def library(model, prompt, n, **kwargs):
    return generate(model, torch.tensor(prompt), n, temperature=0, **kwargs)[len(prompt) :].tolist()


def test_greedy_from_a_preset_matches_the_library(capsys):
    assert main(["generate", "--preset", "tiny", "--prompt-ids", "5 6 7", "--max-new-tokens", "6",
                 "--temperature", "0", "--seed", "1"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    torch.manual_seed(1)
    expected = library(TransformerLM.from_preset("tiny").eval(), [5, 6, 7], 6)
    assert captured.out.split() == [str(t) for t in expected]
    assert captured.err == ""  # stderr is not a terminal here: no progress bar


@pytest.mark.parametrize("kind", ["run", "step", "folder", "file"])
def test_text_from_every_kind_of_checkpoint_is_the_librarys(run, capsys, kind):
    manager = RunDir(run).checkpoints()
    step = manager.path(manager.steps()[-1])
    path = {"run": run, "step": step, "folder": step, "file": step / "model.safetensors"}[kind]
    argv = ["generate", "--checkpoint", str(path), "--prompt", "The ", "--max-new-tokens", "12", "--temperature", "0"]
    if kind in ("folder", "file"):
        argv += ["--tokenizer", str(run / "tokenizer")]
    assert main([*argv, "--stop", ""]) == 0
    tokenizer, model = RunDir(run).tokenizer(), load_model_file(step).eval()
    ids = tokenizer.encode("The ")
    assert capsys.readouterr().out == tokenizer.decode(library(model, ids, 12)) + "\n"


class Recorder(io.StringIO):
    """stdout that records each write: streaming means many writes, each as a token arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_text_is_printed_as_it_is_generated_and_multibyte_characters_print_whole(run, monkeypatch):
    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "--checkpoint", str(run), "--prompt", "é", "--max-new-tokens", "20", "--temperature", "0",
                 "--stop", ""]) == 0  # fmt: skip
    pieces = [w for w in out.writes if w]
    assert len(pieces) >= 5  # token by token, not once at the end
    assert all("\ufffd" not in p or p == "\ufffd" for p in pieces)
    assert "".join(pieces) == out.getvalue()


def test_stop_text_ends_generation_and_is_not_printed(run, capsys):
    tokenizer, model = RunDir(run).tokenizer(), load_model_file(RunDir(run).checkpoints().path(24)).eval()
    ids = tokenizer.encode("The ")
    # Sampled, not greedy: this briefly trained model's greedy text is all spaces. The library's tokens for the seed.
    new = generate(model, torch.tensor(ids), 30, temperature=1.0, generator=torch.Generator().manual_seed(3))
    new = new[len(ids) :].tolist()
    full = tokenizer.decode(new)
    # A stop text split across two tokens (the last character of one, the first of the next) at its first occurrence,
    # past the first few characters: no part of it may be printed before the second token arrives.
    prefixes = [tokenizer.decode(new[:i]) for i in range(1, len(new) - 1)]
    ends = [len(text) for text in prefixes if full.startswith(text) and len(text) >= 5]  # one token's end
    stop = next((full[e - 1 : e + 1] for e in ends if full.find(full[e - 1 : e + 1]) == e - 1), None)
    assert stop is not None
    argv = ["generate", "--checkpoint", str(run), "--prompt", "The ", "--max-new-tokens", "30", "--seed", "3"]
    for stops in (["--stop", stop], ["--stop", stop, "--stop", "never-appears"]):  # held back 1 character, then 12
        assert main([*argv, *stops]) == 0
        assert capsys.readouterr().out == full[: full.index(stop)] + "\n"


def test_end_of_text_stops_by_default_and_eos_id_takes_the_special_token(run, capsys, monkeypatch):
    import tlm_command.generate as command

    (eot,) = RunDir(run).tokenizer().encode("<|endoftext|>")
    real = command.load_model

    def eot_first(*args, **kwargs):  # the run's model, with <|endoftext|> made the certain next token
        model, tokenizer, artifact = real(*args, **kwargs)
        model.lm_head.register_forward_hook(lambda module, inputs, out: out.index_fill(-1, torch.tensor([eot]), 1e4))
        return model, tokenizer, artifact

    monkeypatch.setattr(command, "load_model", eot_first)
    argv = ["generate", "--checkpoint", str(run), "--prompt", "The ", "--max-new-tokens", "5", "--temperature", "0"]
    assert main(argv) == 0
    assert capsys.readouterr().out == "\n"  # stopped at <|endoftext|>, which is not printed
    assert main([*argv, "--stop", "", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == [eot] * 5  # no stop: it goes on
    assert main([*argv, "--stop", "", "--eos-id", "<|endoftext|>", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == [eot]


def test_a_generation_longer_than_the_context_slides_instead_of_failing(small_checkpoint, capsys):
    model, path = small_checkpoint  # context 16
    prompt = list(range(1, 15))
    assert main(["generate", "--checkpoint", str(path), "--prompt-ids", " ".join(map(str, prompt)),
                 "--max-new-tokens", "40", "--temperature", "0", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["ids"] == library(model, prompt, 40)


def test_a_prompt_longer_than_the_context_is_reported_in_one_line_unless_quiet(small_checkpoint, capsys):
    model, path = small_checkpoint  # context 16: a longer prompt keeps its newest 16 - 16 // 4 = 12 tokens
    prompt = list(range(1, 21))
    argv = ["generate", "--checkpoint", str(path), "--prompt-ids", " ".join(map(str, prompt)), "--max-new-tokens",
            "3", "--temperature", "0", "--json"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ids"] == library(model, prompt[-12:], 3)  # what it says it kept
    assert captured.err == (
        "tlm: the prompt has 20 tokens, more than the model's context of 16: generating from its last 12 "
        "(the window keeps room for new tokens)\n"
    )
    assert main([*argv, "--quiet"]) == 0 and capsys.readouterr().err == ""
    exact = prompt[:16]  # exactly the context long: nothing is dropped, nothing is said
    argv[argv.index("--prompt-ids") + 1] = " ".join(map(str, exact))
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ids"] == library(model, exact, 3) and captured.err == ""


def test_device_and_dtype(small_checkpoint, capsys):
    model, path = small_checkpoint
    argv = ["generate", "--checkpoint", str(path), "--prompt-ids", "3 4", "--max-new-tokens", "5"]
    assert main([*argv, "--temperature", "0", "--device", "cpu", "--dtype", "float64"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in library(model.double(), [3, 4], 5)]


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--prompt-ids", "a b"], "--prompt-ids must be integers separated by spaces or commas, got 'a b'"),
        (["--prompt-ids", ""], "--prompt-ids is empty; give at least one token id"),
        (["--prompt-ids", "5 -1"], "--prompt-ids must be in [0, 50) for this model's vocabulary, got [-1]"),
        (["--prompt-ids", "50 3 99999"], "got [50, 99999]"),
        (["--prompt-ids", "1", "--temperature", "-1"], "--temperature: must be a finite number >= 0"),
        (["--prompt-ids", "1", "--temperature", "inf"], "--temperature: must be a finite number >= 0"),
        (["--prompt-ids", "1", "--top-p", "0"], "--top-p: must be a number in (0, 1], got '0'"),
        (["--prompt-ids", "1", "--top-k", "0"], "--top-k: must be a positive integer, got 0"),
        (["--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens: must be a positive integer, got 0"),
        (
            ["--prompt-ids", "1", "--seed", str(2**64)],
            f"--seed: must be an integer in [-2**63, 2**64 - 1], got '{2**64}'",
        ),
        (["--prompt-ids", "1", "--eos-id", "-1"], "--eos-id must be in [0, 50) for this model's vocabulary, got -1"),
        (["--prompt-ids", "1", "--eos-id", "eot"], "--eos-id must be a token id or one of the tokenizer's special"),
        (["--prompt-ids", "1", "--eos-id", "50"], "--eos-id must be in [0, 50) for this model's vocabulary, got 50"),
        (["--prompt-ids", "1", "--stop", "x"], "--stop TEXT needs a tokenizer"),
        (["--prompt", "hi"], "--prompt needs a tokenizer"),
        (
            ["--prompt", "a\udcffb"],
            "--prompt must be UTF-8 text, got bytes that are not (a lone surrogate at character 1",
        ),
        (["--prompt-ids", "1", "--stop", "\udcff"], "--stop must be UTF-8 text"),
        (["--prompt-ids", "1", "--dtype", "float8"], "--dtype: invalid choice: 'float8'"),
        (["--prompt-ids", "1", "--device", "quantum"], "--device must be a torch device such as cpu, cuda or cuda:1"),
        (["--prompt-ids", "1", "--preset", "tiny"], "--preset builds random weights; a --checkpoint carries"),
    ],
)
def test_argument_errors_are_one_line(small_checkpoint, fails, extra, fragment):
    fails(["generate", "--checkpoint", str(small_checkpoint[1]), "--max-new-tokens", "3", *extra], fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_a_missing_cuda_device_is_one_line(small_checkpoint, fails):
    argv = ["generate", "--checkpoint", str(small_checkpoint[1]), "--prompt-ids", "1", "--device", "cuda"]
    fails(argv, "--device cuda: this torch has no CUDA device")


def test_missing_damaged_and_foreign_checkpoints_are_one_line(tmp_path, fails):
    argv = ["--prompt-ids", "1", "--max-new-tokens", "2", "--quiet"]
    fails(["generate", "--checkpoint", str(tmp_path / "nowhere"), *argv], "no such file or folder")
    fails(["generate", "--checkpoint", str(tmp_path), *argv], "is not a tlm run folder, step folder or model folder")
    fails(["generate", *argv], "generate needs --checkpoint PATH (or --preset NAME for random weights)")
    save_model_file(TransformerLM(ModelConfig(11, 8, 8, 1, 2, 8)), tmp_path / "m")
    data = bytearray((tmp_path / "m" / "model.safetensors").read_bytes())
    data[-1] ^= 0x10
    (tmp_path / "m" / "model.safetensors").write_bytes(bytes(data))
    fails(["generate", "--checkpoint", str(tmp_path / "m"), *argv], "model.safetensors is corrupt")


def test_allowed_special_none_keeps_special_token_text_as_text(run, capsys):
    from tlm_tokenizer import Tokenizer

    tokenizer = Tokenizer.load(run / "tokenizer")
    argv = ["generate", "--checkpoint", str(run), "--prompt", "a<|endoftext|>", "--max-new-tokens", "1", "--quiet",
            "--json", "--temperature", "0"]  # fmt: skip
    assert main(argv) == 0  # today's default: the text is the special token
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == tokenizer.encode(
        "a<|endoftext|>", allowed_special="all"
    )
    assert main([*argv, "--allowed-special", "none"]) == 0
    ids = json.loads(capsys.readouterr().out)["prompt_ids"]
    assert ids == tokenizer.encode("a<|endoftext|>", allowed_special="none") and len(ids) > 2


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_fifo_as_a_tokenizer_file_is_one_line_not_a_hang(run, tmp_path, fails, name):
    import shutil
    import threading

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "tokenizer" / name).unlink()
    os.mkfifo(copy / "tokenizer" / name)  # no writer: a blocking open would wait for ever
    outcome = {}

    def generate():
        argv = ["generate", "--checkpoint", str(copy), "--prompt", "a", "--max-new-tokens", "1"]
        outcome["err"] = fails(argv, f"{copy / 'tokenizer' / name}: a FIFO (named pipe), expected a regular file")

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and "err" in outcome


def test_a_busy_machine_is_said_in_one_line_unless_quiet(small_checkpoint, capsys, monkeypatch):
    # As tlm train's test: three other processes busy on a 2-CPU machine, OMP_NUM_THREADS unset; generate computes
    # on the free core, says so in one line, and --quiet says nothing of it.
    _, path = small_checkpoint
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    argv = ["generate", "--checkpoint", str(path), "--prompt-ids", "1 2", "--max-new-tokens", "1", "--temperature",
            "0"]  # fmt: skip
    previous = torch.get_num_threads()
    try:
        for quiet in (False, True):
            torch.set_num_threads(2)
            assert main([*argv, "--quiet"] if quiet else argv) == 0
            assert torch.get_num_threads() == 1
            busy = [line for line in capsys.readouterr().err.splitlines() if "the machine is busy" in line]
            assert len(busy) == (0 if quiet else 1), busy
    finally:
        torch.set_num_threads(previous)
