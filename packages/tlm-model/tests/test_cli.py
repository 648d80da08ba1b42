"""The ``tlm`` command: every user error is one ``tlm: error:`` line and status 2, never a traceback."""

import importlib.metadata
import io
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import tlm_model.cli as cli
from tlm_model import PRESETS, ModelConfig, TransformerLM, generate, save_checkpoint
from tlm_model.cli import main

TINY = "course-tinystories"
# Most commands run on a checkpoint of this small model: building the smallest preset takes seconds.
SMALL = ModelConfig(vocab_size=50, context_length=16, d_model=16, num_layers=1, num_heads=2, d_ff=24)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(model, checkpoint folder) of a SMALL model."""
    torch.manual_seed(3)
    model = TransformerLM.from_config(SMALL).eval()
    return model, save_checkpoint(model, tmp_path_factory.mktemp("small"))


@pytest.fixture
def base(small):
    return ["generate", "--checkpoint", str(small[1]), "--max-new-tokens", "4", "--quiet"]


def fails(capsys, argv, *fragments, code=2):
    """Run ``tlm argv``; it must exit with ``code`` after printing exactly one stderr line and nothing on stdout."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == code, err
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("tlm: error: " if code == 2 else "tlm: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


def library_greedy(model, prompt, n):
    return generate(model, torch.tensor(prompt), n, temperature=0)[len(prompt) :].tolist()


# ---------------------------------------------------------------------------------------------
# tlm, tlm --version, python -m tlm_model


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"tlm {importlib.metadata.version('tlm-model')} (tlm-model)\n"


@pytest.mark.slow  # two new interpreters, each importing torch
def test_python_dash_m_runs_the_command_and_its_errors_have_no_traceback(tmp_path):
    run = [sys.executable, "-m", "tlm_model"]
    ok = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=300)
    assert (ok.returncode, ok.stdout) == (0, f"tlm {importlib.metadata.version('tlm-model')} (tlm-model)\n")
    (tmp_path / "model.safetensors").write_bytes(b"\x07" * 40)
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt-ids", "1", "--max-new-tokens", "1"]
    bad = subprocess.run([*run, *argv], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("tlm: error: ") and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    assert str(tmp_path / "model.safetensors") in bad.stderr


@pytest.mark.parametrize(
    "argv, fragment",
    [
        ([], "the following arguments are required: COMMAND"),
        (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
        (["info", "--preset", "gpt3"], "info: argument --preset: invalid choice: 'gpt3'"),
        (["info", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
    ids=["no-command", "unknown-command", "unknown-preset", "unknown-option"],
)
def test_argument_errors_are_one_line(capsys, argv, fragment):
    fails(capsys, argv, fragment)


# ---------------------------------------------------------------------------------------------
# tlm info


def test_info_json_without_a_preset_is_json_for_every_preset(capsys):
    assert main(["info", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert list(listing) == list(PRESETS)
    for name in PRESETS:
        assert main(["info", "--preset", name, "--json"]) == 0
        assert listing[name] == json.loads(capsys.readouterr().out)
        meta = TransformerLM.from_preset(name, device="meta")
        assert listing[name]["parameters"] == sum(p.numel() for p in meta.parameters())


# ---------------------------------------------------------------------------------------------
# tlm accounting


@pytest.mark.parametrize(
    "argv, fragment",
    [
        ([], "one of the arguments --preset --compare is required"),
        (["--preset", "gpt2-xl", "--compare", "gpt2-small"], "not allowed with argument"),
        (["--preset", "gpt2-xl", "--context-length", "0"], "--context-length: must be a positive integer, got 0"),
        (["--preset", "gpt2-xl", "--context-length", "x"], "--context-length: must be a positive integer, got 'x'"),
        (["--preset", "gpt2-xl", "--batch-size", "-2"], "--batch-size: must be a positive integer, got -2"),
        (["--compare", "gpt2-xl", "gpt5"], "invalid choice: 'gpt5'"),
    ],
    ids=["neither", "both", "context-0", "context-x", "batch-negative", "unknown-compare"],
)
def test_accounting_argument_errors(capsys, argv, fragment):
    fails(capsys, ["accounting", *argv], "tlm: error: accounting: ", fragment)


@pytest.fixture
def no_report(monkeypatch):
    """Fails the test if the accounting report is computed."""
    monkeypatch.setattr(cli, "account", lambda *a, **k: pytest.fail("the report was computed before the check"))


def test_plot_without_matplotlib_fails_before_the_report(capsys, monkeypatch, tmp_path, no_report):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", None)
    fails(capsys, ["accounting", "--preset", "gpt2-xl", "--plot", str(tmp_path / "a.png")],
          "--plot needs matplotlib: pip install 'tlm-model[plot]'")  # fmt: skip


def test_plot_into_a_missing_folder_fails_before_the_report(capsys, tmp_path, no_report):
    pytest.importorskip("matplotlib", reason="the folder is checked after matplotlib is found")
    target = tmp_path / "nowhere" / "a.png"
    fails(capsys, ["accounting", "--preset", "gpt2-xl", "--plot", str(target)],
          f"the folder {tmp_path / 'nowhere'} does not exist")  # fmt: skip
    assert not (tmp_path / "nowhere").exists()


def test_plot_in_an_unknown_format_fails_before_the_report(capsys, tmp_path, no_report):
    pytest.importorskip("matplotlib", reason="the formats are matplotlib's")
    fails(capsys, ["accounting", "--preset", "gpt2-xl", "--plot", str(tmp_path / "a.docx")],
          "unknown image format 'docx'; expected one of [")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# tlm generate: results


def test_generate_greedy_matches_the_library(capsys):
    assert main(["generate", "--preset", TINY, "--prompt-ids", "5 6 7", "--max-new-tokens", "6",
                 "--temperature", "0", "--seed", "1"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    torch.manual_seed(1)
    expected = library_greedy(TransformerLM.from_preset(TINY).eval(), [5, 6, 7], 6)
    assert captured.out.split() == [str(t) for t in expected]
    assert captured.err == ""  # stderr is not a terminal here: no progress bar


def make_trained(seed=2):
    torch.manual_seed(seed)
    return TransformerLM.from_config(SMALL).eval()


@pytest.mark.parametrize("kind", ["folder", "file", "pt", "plain-safetensors"])
def test_generate_from_each_kind_of_checkpoint(tmp_path, capsys, kind):
    model = make_trained()
    if kind == "folder":
        path, extra = save_checkpoint(model, tmp_path / "ckpt"), []
    elif kind == "file":
        path, extra = save_checkpoint(model, tmp_path / "m.safetensors"), []
    elif kind == "pt":
        path, extra = tmp_path / "weights.pt", ["--preset", TINY]
        model = TransformerLM.from_preset(TINY).eval()
        torch.save(model.state_dict(), path)
    else:
        path, extra = tmp_path / "weights.safetensors", ["--preset", TINY]
        model = TransformerLM.from_preset(TINY).eval()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    argv = ["generate", "--checkpoint", str(path), *extra, "--prompt-ids", "1,2", "--max-new-tokens", "4"]
    assert main([*argv, "--temperature", "0", "--quiet"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in library_greedy(model, [1, 2], 4)]


def test_generate_device_and_dtype(tmp_path, capsys):
    model = make_trained()
    save_checkpoint(model, tmp_path)
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt-ids", "3 4", "--max-new-tokens", "5"]
    assert main([*argv, "--temperature", "0", "--device", "cpu", "--dtype", "float64"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in library_greedy(model.double(), [3, 4], 5)]


# ---------------------------------------------------------------------------------------------
# tlm generate: errors


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--prompt-ids", "a b"], "--prompt-ids must be integers separated by spaces or commas, got 'a b'"),
        (["--prompt-ids", ""], "--prompt-ids is empty; give at least one token id"),
        (["--prompt-ids", " , "], "--prompt-ids is empty"),
        (["--prompt-ids", "5 -1"], "--prompt-ids must be in [0, 50) for this model's vocabulary, got [-1]"),
        (["--prompt-ids", "50 3 99999"], "got [50, 99999]"),
        (["--prompt-ids", " ".join(["1"] * 13)], "prompt (13 tokens) + max_new_tokens (4) exceeds the model's context"),
        (["--temperature", "-1"], "--temperature: must be a finite number >= 0 (0 decodes greedily), got '-1'"),
        (["--temperature", "nan"], "--temperature: must be a finite number >= 0"),
        (["--temperature", "inf"], "--temperature: must be a finite number >= 0"),
        (["--temperature", "warm"], "--temperature: must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p: must be a number in (0, 1], got '0'"),
        (["--top-p", "1.5"], "--top-p: must be a number in (0, 1], got '1.5'"),
        (["--top-p", "nan"], "--top-p: must be a number in (0, 1]"),
        (["--top-k", "0"], "--top-k: must be a positive integer, got 0"),
        (["--top-k", "1.5"], "--top-k: must be a positive integer, got '1.5'"),
        (["--max-new-tokens", "0"], "--max-new-tokens: must be a positive integer, got 0"),
        (["--eos-id", "-1"], "--eos-id: must be a token id (an integer >= 0), got -1"),
        (["--eos-id", "50"], "--eos-id must be in [0, 50) for this model's vocabulary, got 50"),
        (["--seed", "x"], "--seed: invalid int value: 'x'"),
        (["--dtype", "float8"], "--dtype: invalid choice: 'float8'"),
        (["--device", "quantum"], "--device must be a torch device such as cpu, cuda or cuda:1, got 'quantum'"),
        (["--preset", "gpt3"], "--preset: invalid choice: 'gpt3'"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_generate_argument_errors(capsys, base, extra, fragment):
    fails(capsys, [*base, "--prompt-ids", "1 2", *extra], fragment)


def test_generate_needs_a_model(capsys):
    fails(capsys, ["generate", "--prompt-ids", "1", "--max-new-tokens", "2"],
          "generate needs --preset (random weights) or --checkpoint")  # fmt: skip
    fails(capsys, ["generate", "--preset", TINY, "--max-new-tokens", "2"],
          "generate: one of the arguments --prompt-ids --prompt is required")  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_generate_on_a_missing_cuda_device(capsys, base):
    fails(capsys, [*base, "--prompt-ids", "1", "--device", "cuda"], "--device cuda: this torch has no CUDA device")


def ckpt_args(path, *extra):
    return ["generate", "--checkpoint", str(path), *extra, "--prompt-ids", "1", "--max-new-tokens", "2", "--quiet"]


def test_generate_from_a_missing_checkpoint(capsys, tmp_path):
    fails(capsys, ckpt_args(tmp_path / "nowhere"), f"no such checkpoint (file or folder): {tmp_path / 'nowhere'}\n")
    fails(capsys, ckpt_args(tmp_path), "not a tlm checkpoint: missing model.safetensors", str(tmp_path))


def test_generate_from_a_corrupt_checkpoint(capsys, tmp_path):
    save_checkpoint(TransformerLM.from_config(ModelConfig(11, 8, 8, 1, 2, 8)), tmp_path)
    data = bytearray((tmp_path / "model.safetensors").read_bytes())
    data[-1] ^= 0x10
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    fails(capsys, ckpt_args(tmp_path), f"{tmp_path / 'model.safetensors'} is corrupt: its content hash is")
    (tmp_path / "model.safetensors").write_bytes(bytes(data[:100]))
    fails(capsys, ckpt_args(tmp_path), f"{tmp_path / 'model.safetensors'} is truncated")


def test_generate_from_a_mismatched_checkpoint(capsys, tmp_path):
    save_checkpoint(TransformerLM.from_config(ModelConfig(11, 8, 8, 1, 2, 8)), tmp_path)
    expected = f"checkpoint config mismatch in {tmp_path / 'model.safetensors'}: vocab_size is 11"
    fails(capsys, ckpt_args(tmp_path, "--preset", TINY), expected)


def test_generate_from_a_state_dict_without_a_preset(capsys, tmp_path):
    torch.save(TransformerLM.from_config(ModelConfig(11, 8, 8, 1, 2, 8)).state_dict(), tmp_path / "w.pt")
    fails(capsys, ckpt_args(tmp_path / "w.pt"), "w.pt is a plain state dict that carries no config")
    fails(capsys, ckpt_args(tmp_path / "w.pt", "--preset", TINY), "w.pt does not match config=: ")


def test_generate_from_a_checkpoint_folder_that_cannot_be_read(capsys, tmp_path):
    (tmp_path / "model.safetensors").mkdir()  # a folder where the file should be
    fails(capsys, ckpt_args(tmp_path), "not a tlm checkpoint")


# ---------------------------------------------------------------------------------------------
# the progress bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def on_a_terminal(monkeypatch) -> Terminal:
    # Called in the test body: pytest's capture re-installs its own sys.stderr after fixtures run.
    stderr = Terminal()
    monkeypatch.setattr(sys, "stderr", stderr)
    return stderr


def test_progress_bar_on_a_terminal_closes_its_line_when_eos_stops_early(capsys, monkeypatch, small):
    model, path = small
    first = library_greedy(model, [5, 6], 1)[0]
    argv = ["generate", "--checkpoint", str(path), "--prompt-ids", "5 6", "--max-new-tokens", "6", "--temperature", "0"]
    terminal = on_a_terminal(monkeypatch)
    assert main([*argv, "--eos-id", str(first)]) == 0
    assert capsys.readouterr().out.split() == [str(first)]
    bar = terminal.getvalue()
    assert bar.endswith("\n") and "1/6" in bar.rsplit("\r", 1)[-1]


def test_progress_bar_is_silenced_by_quiet(capsys, monkeypatch, base):
    terminal = on_a_terminal(monkeypatch)
    assert main([*base, "--prompt-ids", "1"]) == 0
    assert terminal.getvalue() == ""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_rate_excludes_the_prefill(capsys, monkeypatch, small):
    # A fake clock: prefill takes 10 s, then each of 4 more tokens 1 s. Decoding runs at 1 tok/s;
    # counting the prefill would show 5 tokens / 14 s = 0.36 tok/s.
    import tqdm.std

    clock = Clock()
    monkeypatch.setattr(tqdm.std, "time", clock)

    def fake_generate(model, prompt, n, *, on_token, **kwargs):
        clock.now += 10  # the prefill, which also yields the first token
        on_token(1)
        for step in range(2, 6):
            clock.now += 1
            on_token(step)
        return torch.cat([prompt, torch.zeros(5, dtype=prompt.dtype)])

    monkeypatch.setattr(cli, "generate", fake_generate)
    terminal = on_a_terminal(monkeypatch)
    assert main(["generate", "--checkpoint", str(small[1]), "--prompt-ids", "1", "--max-new-tokens", "5"]) == 0
    final = terminal.getvalue().rsplit("\r", 1)[-1]
    assert "5/5" in final and "1.00tok/s" in final and final.endswith("\n"), final


@pytest.mark.parametrize("fault, code, message", [(KeyboardInterrupt, 130, "tlm: interrupted"),
                                                  (ValueError, 2, "tlm: error: boom")])  # fmt: skip
def test_progress_bar_closes_its_line_when_generation_is_interrupted(capsys, monkeypatch, small, fault, code, message):
    def fake_generate(model, prompt, n, *, on_token, **kwargs):
        on_token(1)
        on_token(2)
        raise fault("boom")

    monkeypatch.setattr(cli, "generate", fake_generate)
    terminal = on_a_terminal(monkeypatch)
    with pytest.raises(SystemExit) as info:
        main(["generate", "--checkpoint", str(small[1]), "--prompt-ids", "1", "--max-new-tokens", "5"])
    assert info.value.code == code
    lines = terminal.getvalue().split("\n")
    # The bar's own line ends before the message, which is alone on the last line.
    assert "2/5" in lines[-3] and lines[-2] == message and lines[-1] == ""


# ---------------------------------------------------------------------------------------------
# plugins: the tlm.cli entry-point group


class FakeEntryPoint:
    def __init__(self, name, target):
        self.name, self.value, self.target = name, f"fake_plugin:{name}", target

    def load(self):
        if isinstance(self.target, BaseException):
            raise self.target
        return self.target


@pytest.fixture
def plugins(monkeypatch):
    """``plugins(*entry_points)`` makes them what importlib.metadata finds in the tlm.cli group."""

    def install(*entry_points):
        real = importlib.metadata.entry_points

        def fake(**kwargs):
            return list(entry_points) if kwargs.get("group") == "tlm.cli" else real(**kwargs)

        monkeypatch.setattr(importlib.metadata, "entry_points", fake)

    return install


def register_hello(subparsers):
    hello = subparsers.add_parser("hello", help="a plugin's command")
    hello.add_argument("--name", required=True)
    hello.add_argument("--fail", choices=["value", "type", "os", "interrupt"])
    hello.set_defaults(handler=hello_handler)


def hello_handler(args):
    faults = {
        "value": ValueError("bad name\nsecond line"),
        "type": TypeError("wrong type"),
        "os": FileNotFoundError(2, "No such file or directory", "/x/tok.json"),
        "interrupt": KeyboardInterrupt(),
    }
    if args.fail:
        raise faults[args.fail]
    print(f"hello {args.name}")
    return 3 if args.name == "three" else 0


def test_a_plugin_adds_a_command(capsys, plugins):
    plugins(FakeEntryPoint("hello", register_hello))
    assert main(["hello", "--name", "ada"]) == 0
    assert capsys.readouterr().out == "hello ada\n"
    assert main(["hello", "--name", "three"]) == 3  # the handler's status is main's
    capsys.readouterr()
    fails(capsys, ["hello"], "hello: the following arguments are required: --name")


@pytest.mark.parametrize(
    "fail, code, message",
    [
        ("value", 2, "tlm: error: bad name\n"),
        ("type", 2, "tlm: error: wrong type\n"),
        ("os", 2, "tlm: error: No such file or directory: /x/tok.json\n"),
        ("interrupt", 130, "tlm: interrupted\n"),
    ],
)
def test_a_plugin_handlers_errors_are_one_line(capsys, plugins, fail, code, message):
    plugins(FakeEntryPoint("hello", register_hello))
    with pytest.raises(SystemExit) as info:
        main(["hello", "--name", "x", "--fail", fail])
    assert info.value.code == code
    assert capsys.readouterr() == ("", message)


@pytest.mark.parametrize(
    "target",
    [ImportError("No module named 'tlm_tokenizer'"), lambda subparsers: 1 / 0],
    ids=["import-fails", "register-fails"],
)
def test_a_broken_plugin_leaves_the_built_in_commands_working(capsys, plugins, target):
    plugins(FakeEntryPoint("broken", target), FakeEntryPoint("hello", register_hello))
    assert main(["info", "--preset", TINY, "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["preset"] == TINY
    assert err.count("\n") == 1 and err.startswith("tlm: warning: plugin 'broken' (fake_plugin:broken) not loaded: ")
    assert main(["hello", "--name", "ada"]) == 0  # the good plugin still loads


def test_built_in_commands_dispatch_through_handler():
    parser = cli.build_parser()
    needs = {"accounting": ["--preset", "gpt2-xl"], "generate": ["--prompt-ids", "1", "--max-new-tokens", "1"]}
    for command in ("info", "accounting", "generate"):
        assert callable(parser.parse_args([command, *needs.get(command, [])]).handler)
