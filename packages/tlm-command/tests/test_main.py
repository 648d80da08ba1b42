"""The ``tlm`` command itself: version, ``python -m tlm``, one-line errors, and help that shows every default."""

import argparse
import importlib.metadata
import json
import subprocess
import sys

import pytest

from tlm_command.args import _HelpAll
from tlm_command.main import COMMANDS, build_parser, main


def test_version_names_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for dist in ("tlm-command", "tlm-model", "tlm-train", "tlm-tokenizer", "torch"):
        assert f"{dist} {importlib.metadata.version(dist)}" in out


def test_version_says_which_distribution_is_not_installed(capsys, monkeypatch):
    # A source checkout without one distribution's metadata: importlib.metadata raises PackageNotFoundError.
    real = importlib.metadata.version

    def version(dist):
        if dist == "tlm-train":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"tlm-model {real('tlm-model')}, tlm-train (not installed), tlm-tokenizer {real('tlm-tokenizer')}" in out


@pytest.mark.slow  # new interpreters, each importing torch
def test_python_dash_m_tlm_runs_the_command_and_its_errors_have_no_traceback(tmp_path, tlm):
    ok = tlm("info", "--preset", "tiny", "--json")
    assert ok.returncode == 0 and '"d_model": 128' in ok.stdout
    (tmp_path / "model.safetensors").write_bytes(b"\x07" * 40)
    bad = tlm("generate", "--checkpoint", tmp_path, "--prompt-ids", "1", "--max-new-tokens", "1")
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
        (["train", "--steps", "x"], "train: argument --steps: invalid int value: 'x'"),
    ],
    ids=["no-command", "unknown-command", "unknown-preset", "unknown-option", "bad-int"],
)
def test_argument_errors_are_one_line(fails, argv, fragment):
    fails(argv, fragment)


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction, _HelpAll)):
            yield parser.prog, action


def test_every_flag_of_every_command_has_help_and_shows_its_default():
    parser = build_parser()
    assert [a.dest for _, a in _actions(parser)]  # something was walked
    for prog, action in _actions(parser):
        if not action.option_strings:
            continue
        assert action.help, f"{prog} {action.option_strings[0]} has no help"
        rendered = parser._get_formatter()._get_help_string(action)  # what --help prints for it
        shown = "(default:" in rendered or "(tiny:" in rendered or action.required
        if prog == "tlm train" and action.dest not in ("config", "resume", "quiet"):
            assert shown, f"{prog} {action.option_strings[0]}: {rendered}"  # a setting: its dataclass default
        else:
            assert shown or action.default in (None, False), f"{prog} {action.option_strings[0]}: {rendered}"
        assert rendered.count("default:") <= 1, f"{prog} {action.option_strings[0]} shows its default twice: {rendered}"


def _train_parser():
    return build_parser()._subparsers._group_actions[0].choices["train"]


def test_train_help_is_short_and_help_all_shows_every_flag_with_its_one_default(capsys):
    parser = _train_parser()
    short = parser.format_help()
    assert "(default: 0.003)" in short and "(default: tiny)" in short and "--help-all" in short
    assert "{tiny,course-tinystories,gpt2-small,gpt2-medium,gpt2-large,gpt2-xl}" in short  # choices listed
    assert "--beta1" in short and "AdamW β1" not in short  # named, explained only by --help-all
    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    full = capsys.readouterr().out
    assert "AdamW β1 (default: 0.9)" in full and "(default: lr / 10)" in full
    # Model flags sit under the preset they override, each showing that preset's value once.
    assert "width of the residual stream (tiny: 128)" in full and "the preset's" not in full
    # --help-all grows with every field (each is a flag); the short help does not.
    assert len(short.splitlines()) < 60 and len(full.splitlines()) < len(short.splitlines()) * 3.5


def test_each_train_flag_takes_its_help_default_and_choices_from_the_field_it_sets():
    import dataclasses

    from tlm_model import PRESETS, ModelConfig
    from tlm_train import TrainConfig

    actions = {a.dest: a for a in _train_parser()._actions}
    sources = [
        (f.name, f, TrainConfig().to_dict()[f.name]) for f in dataclasses.fields(TrainConfig) if f.name != "model"
    ]
    sources += [(f"model.{f.name}", f, getattr(PRESETS["tiny"], f.name)) for f in dataclasses.fields(ModelConfig)]
    for dest, field, default in sources:
        if dest == "model.vocab_size":  # the tokenizer's: no flag
            assert dest not in actions
            continue
        assert field.metadata.get("help"), f"{field.name} has no help in its field metadata"
        action = actions[dest]
        assert action.help.startswith(field.metadata["help"].replace("%", "%%")), dest
        assert list(action.choices or []) == list(field.metadata.get("choices", [])), dest
        if default not in (None, [], {}) and not isinstance(default, bool):
            rendered = " ".join(map(str, default)) if isinstance(default, list) else str(default)
            assert rendered.strip() in action.help, (dest, action.help)


def test_parsing_imports_no_torch_for_help_or_for_any_argument_error():
    # A fresh interpreter: this one has torch already. Each argv parses (and fails or prints help) before torch loads.
    argvs = [["--help"], ["train", "--help"], ["train", "--help-all"], ["train", "--lr", "-1"],
             ["train", "--steps", "x"], ["train", "--d-model", "30"], ["train", "--rope-layout", "diagonal"],
             ["frobnicate"], *[[name, "--help"] for name in COMMANDS]]  # fmt: skip
    code = (
        "import contextlib, io, json, sys\n"
        "from tlm_command.main import main\n"
        "codes = []\n"
        f"for argv in {argvs!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as exit:\n"
        "            codes.append((exit.code, err.getvalue().count('\\n')))\n"
        "print(json.dumps({'codes': codes, 'torch': 'torch' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    assert result["torch"] is False
    # Help exits 0 with nothing on stderr; each error exits 2 with one stderr line.
    assert result["codes"] == [[0, 0]] * 3 + [[2, 1]] * 5 + [[0, 0]] * len(COMMANDS), result


def test_the_dtype_names_parsed_without_torch_are_tlm_cores():
    from tlm_command.args import DTYPE_NAMES
    from tlm_core.tensors import DTYPES

    assert sorted(DTYPE_NAMES) == sorted(DTYPES)


def test_every_command_is_a_module_with_a_parser():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == set(COMMANDS)
    assert all(callable(sub.get_default("run")) or sub.get_default("run") is None for sub in commands.values())
