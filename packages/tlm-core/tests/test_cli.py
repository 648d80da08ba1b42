"""tlm_core.cli: the argparse types refuse what is not positive, and a subcommand's help is its docstring's body."""

import argparse

import pytest

from tlm_core.cli import add_command, description, positive_float, positive_int


@pytest.mark.parametrize("text", ["0", "-3", "1.5", "x", ""])
def test_positive_int_refuses_what_is_not_a_positive_integer(text):
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive integer"):
        positive_int(text)


@pytest.mark.parametrize("text", ["0", "-1e-3", "nan", "inf", "x"])
def test_positive_float_refuses_what_is_not_a_positive_finite_number(text):
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive number"):
        positive_float(text)


def test_the_types_read_positive_values_as_argparse_does():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=positive_int)
    parser.add_argument("--x", type=positive_float)
    args = parser.parse_args(["--n", "7", "--x", "2.5e-3"])
    assert (args.n, args.x) == (7, 2.5e-3)


def test_a_subcommand_takes_its_help_from_the_docstring_body():
    doc = """``tlm thing``: the summary line.

    The body, with ``markup`` dropped."""
    commands = argparse.ArgumentParser(prog="tlm").add_subparsers()
    parser = add_command(commands, "thing", "one line", doc)
    assert parser.description == description(doc) == "    The body, with markup dropped."
    assert parser.prog == "tlm thing"
