"""What every command-line front end of a tlm package shares with the libraries it calls: the user error and
the status line. Standard library only.

A library (tlm-experiments, tlm-train) raises :class:`UserError` for a mistake in what it was given; ``tlm``
(tlm-command, which owns all argument parsing) prints it as one line and exits 2.
"""

import sys

__all__ = ["UserError", "say"]


class UserError(Exception):
    """A mistake in the command line or its inputs: printed as one line, exit status 2."""


def say(line: str) -> None:
    """A status line on stderr (above a progress bar, when one is drawn)."""
    print(f"tlm: {line}", file=sys.stderr)
