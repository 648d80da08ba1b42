"""The ``tlm`` command itself: version, ``python -m tlm``, one-line errors, and help that shows every default."""

import argparse
import importlib.metadata

import pytest

from tlm_command.main import COMMANDS, build_parser, main


def test_version_names_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for dist in ("tlm-command", "tlm-model", "tlm-train", "tlm-tokenizer", "torch"):
        assert f"{dist} {importlib.metadata.version(dist)}" in out


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
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield parser.prog, action


def test_every_flag_of_every_command_has_help_and_shows_its_default():
    parser = build_parser()
    assert [a.dest for _, a in _actions(parser)]  # something was walked
    for prog, action in _actions(parser):
        if not action.option_strings:
            continue
        assert action.help, f"{prog} {action.option_strings[0]} has no help"
        rendered = parser._get_formatter()._get_help_string(action)  # what --help prints for it
        shown = "(default:" in rendered or action.required or isinstance(action, argparse._StoreTrueAction)
        assert shown, f"{prog} {action.option_strings[0]}: {rendered}"
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "(default: 0.003)" in text and "(default: tiny)" in text and "(default: the preset's)" in text
    assert "{course-tinystories,gpt2-large,gpt2-medium,gpt2-small,gpt2-xl,tiny}" in text  # choices listed


def test_every_command_is_a_module_with_a_parser():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == set(COMMANDS)
    assert all(callable(sub.get_default("run")) or sub.get_default("run") is None for sub in commands.values())
