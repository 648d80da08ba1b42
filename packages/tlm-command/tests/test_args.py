"""``tlm_command.args``: where each argument type's range begins and ends, and what an output path may not be.

The refusals' messages are asserted by the commands that print them (``test_generate.py``, ``test_eval.py``...);
these are the edges: the smallest and largest values each type still takes, and the first it refuses.
"""

import argparse

import pytest

from tlm_command.args import (
    UserError,
    add_command,
    check_output,
    description,
    positive_float,
    positive_int,
    temperature,
    top_p,
)


@pytest.mark.parametrize(("parse", "text", "value"), [
    (temperature, "0", 0.0),  # greedy
    (temperature, "0.5", 0.5),
    (temperature, "1e300", 1e300),
    (top_p, "1", 1.0),  # the closed end of (0, 1]
    (top_p, "1e-9", 1e-9),
    (positive_int, "1", 1),
    (positive_int, str(2**63 - 1), 2**63 - 1),  # int64's largest: torch and numpy take it
])  # fmt: skip
def test_each_type_takes_the_edges_of_its_range(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize(("parse", "text"), [
    (temperature, "-1e-9"), (temperature, "inf"), (temperature, "nan"),
    (top_p, "0"), (top_p, "1.000001"), (top_p, "nan"),
    (positive_int, "0"), (positive_int, "1.5"), (positive_int, str(2**63)),
])  # fmt: skip
def test_and_refuses_the_first_value_past_them(parse, text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)


@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_an_output_may_not_be_inside_around_or_equal_to_any_input(tmp_path, where):
    source = tmp_path / "in"
    out = {"same": source, "inside": source / "out", "around": tmp_path}[where]
    with pytest.raises(UserError, match=f"^--to {out} would overwrite the input {source}; choose another --to$"):
        # An input given as None (an optional flag left out) is skipped; one beside the output is no conflict.
        check_output(out, None, tmp_path.parent / f"{tmp_path.name}-other", source, flag="--to")


def test_an_output_beside_the_inputs_or_sharing_a_name_prefix_is_allowed(tmp_path):
    check_output(tmp_path / "out", tmp_path / "in", None, tmp_path / "o")
    check_output(tmp_path / "input-2", tmp_path / "input")  # a string prefix, not a parent folder


def test_every_subcommand_has_its_line_in_the_list_and_its_own_help_text():
    import tlm_command.eval
    from tlm_command.args import description
    from tlm_command.main import build_parser

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    lines = {action.dest: action.help for action in commands._choices_actions}
    assert set(lines) == set(commands.choices) and all(lines.values()), lines
    # The --help text of a command declared with a module docstring is that docstring's body.
    assert commands.choices["eval"].description == description(tlm_command.eval.__doc__)


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
