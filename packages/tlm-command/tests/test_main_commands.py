"""``tlm`` itself: ``--help`` lists every subcommand of ``COMMANDS``, in that order, each with its one-line summary
(as ``tlm tokenizer --help`` does its own two); it is named ``tlm`` whatever script runs it; and a command's error
is printed as its first line, cut at 2,000 characters (the module's docstring)."""

import argparse
import sys

from tlm_command.main import COMMANDS, build_parser


def _summaries(parser: argparse.ArgumentParser) -> dict[str, str | None]:
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {choice.dest: choice.help for choice in commands._choices_actions}


def test_every_command_is_listed_with_a_summary_in_the_order_of_commands():
    parser = build_parser()
    summaries = _summaries(parser)
    assert list(summaries) == list(COMMANDS)
    assert all(summaries.values()), summaries
    listing = " ".join(parser.format_help().split())  # the help wraps long summaries
    for name, summary in summaries.items():
        assert f"{name} {' '.join(summary.split())}" in listing, name
    tokenizer = _summaries(parser._subparsers._group_actions[0].choices["tokenizer"])
    assert list(tokenizer) == ["train", "encode"] and all(tokenizer.values()), tokenizer


def test_the_command_is_named_tlm_whatever_script_runs_it(monkeypatch, fails):
    monkeypatch.setattr(sys, "argv", ["/somewhere/tlm_command/__main__.py"])  # as python -m tlm_command sets it
    assert build_parser().format_usage().startswith("usage: tlm [-h]")
    err = fails(["info", "--preset", "gpt3"])
    assert err.startswith("tlm: error: info: argument --preset: invalid choice: 'gpt3'"), err
    assert err.endswith("(see tlm info --help)\n"), err


def test_an_error_prints_its_first_line_cut_at_2000_characters(monkeypatch, fails):
    import tlm_command.info

    def raises(args):
        raise ValueError("é" * 1999 + "xy" + "z" * 5000 + "\nthe second line is not printed")

    monkeypatch.setattr(tlm_command.info, "run", raises)
    assert fails(["info"]) == "tlm: error: " + "é" * 1999 + "x\n"
