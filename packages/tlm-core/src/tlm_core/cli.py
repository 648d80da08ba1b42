"""What every command-line front end of a tlm package shares: the user error, argument types, status lines.

Standard library only, so a parser is built and its errors printed before torch is imported. ``tlm``'s own
commands (tlm-command) and those tlm-experiments defines (``tlm sweep``, ``tlm compare``) use the same ones:
a :class:`UserError` from either prints one line and exits 2.
"""

import argparse
import math
import sys
from typing import Any

__all__ = ["UserError", "add_command", "description", "positive_float", "positive_int", "say"]


class UserError(Exception):
    """A mistake in the command line or its inputs: printed as one line, exit status 2."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def say(line: str) -> None:
    """A status line on stderr (above a progress bar, when one is drawn)."""
    print(f"tlm: {line}", file=sys.stderr)


def add_command(commands: Any, name: str, help: str, doc: str | None, **options: Any) -> Any:
    """The parser of subcommand ``name`` (of the subparsers ``commands``' own parser class): ``help`` is its
    line in the list of commands, ``doc`` (a module docstring, or a sentence) its ``--help`` text, read with
    :func:`description`."""
    return commands.add_parser(name, help=help, description=description(doc), **options)


def description(doc: str | None) -> str:
    """A module docstring as ``--help`` text: its body after the summary line, without reST markup."""
    return (doc or "").split("\n\n", 1)[-1].replace("``", "")
