"""What the commands share: argument types, the help format, and the checks of paths a command writes."""

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch

from tlm_core.tensors import DTYPES, device_from_name


class UserError(Exception):
    """A mistake in the command line or its inputs: printed as one line, exit status 2."""


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default; descriptions keep their line breaks."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line: ``tlm: error: <command>: <message>``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("tlm").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"tlm: error: {where}{message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def temperature(text: str) -> float:
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 decodes greedily), got {text!r}")
    return value


def top_p(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def dtype_choices() -> list[str]:
    return sorted(DTYPES)


def device(text: str) -> torch.device:
    """A torch device this process can use; a clear one-line error otherwise."""
    return device_from_name(text, "--device")


def check_output(out: str | os.PathLike[str], *inputs: str | os.PathLike[str] | None, flag: str = "--out") -> None:
    """An output must never overwrite, contain or sit inside an input: refuse before anything is written."""
    target = Path(out).resolve()
    for source in inputs:
        if source is None:
            continue
        given = Path(source).resolve()
        if target == given or given in target.parents or target in given.parents:
            raise UserError(f"{flag} {out} would overwrite the input {source}; choose another {flag}")


def say(line: str) -> None:
    """A status line on stderr (above a progress bar, when one is drawn)."""
    print(f"tlm: {line}", file=sys.stderr)


def damaged(step: int, error: Exception) -> None:
    say(f"checkpoint of step {step} is damaged ({str(error).splitlines()[0][:160]}); using the one before")


def description(doc: str | None) -> str:
    """A module docstring as ``--help`` text: its body after the summary line, without reST markup."""
    return (doc or "").split("\n\n", 1)[-1].replace("``", "")
