"""What the commands share: argument types, the help format, and the checks of paths a command writes.

Standard library only: every command parses its arguments, and prints its help or a usage error,
before torch is imported (a subcommand module imports torch inside its ``run``).
"""

import argparse
import math
import os
import shutil
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from tlm_core.cli import UserError as UserError
from tlm_core.cli import say as say

if TYPE_CHECKING:
    import torch

#: The dtype names ``--dtype`` takes: ``tlm_core.tensors.DTYPES``'s keys (a test holds them equal), named
#: here so that parsing needs no torch.
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, once; descriptions keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        # No default to show (None, off, or none given), or the help already says it.
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line: ``tlm: error: <command>: <message>``.

    A parser with many flags puts its less common ones in groups made with ``more_group``: ``--help``
    lists their flags by name under one line each, and ``--help-all`` shows them in full.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)
        self.more: list[Any] = []  # argument groups that only --help-all shows in full
        self.full_help = False

    def more_group(self, title: str, description: str | None = None) -> Any:
        """An argument group that ``--help`` lists by flag names only (``--help-all`` in full)."""
        if not self.more:
            self.add_argument("--help-all", action=_HelpAll, help="show every flag with its help and default")
        group = self.add_argument_group(title, description)
        self.more.append(group)
        return group

    def format_help(self) -> str:
        if self.full_help or not self.more:
            return super().format_help()
        hidden = [a for group in self.more for a in group._group_actions]
        helps, descriptions = [a.help for a in hidden], [group.description for group in self.more]
        for action in hidden:
            action.help = argparse.SUPPRESS
        for group in self.more:
            group.description = None
        try:
            text = super().format_help()
        finally:
            for action, help_text in zip(hidden, helps, strict=True):
                action.help = help_text
            for group, text_ in zip(self.more, descriptions, strict=True):
                group.description = text_
        width = min(shutil.get_terminal_size().columns, 120) - 2
        lines = [f"more flags ({self.prog} --help-all shows each with its help and default):"]
        for group in self.more:
            names = " ".join(a.option_strings[0] for a in group._group_actions)
            lines.append(
                textwrap.fill(
                    names, width, initial_indent=f"  {group.title}: ", subsequent_indent="    ", break_on_hyphens=False
                )
            )
        return text + "\n" + "\n".join(lines) + "\n"

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("tlm").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"tlm: error: {where}{message} (see {self.prog} --help)\n")


class _HelpAll(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        parser.full_help = True  # type: ignore[attr-defined]
        parser.print_help()
        parser.exit()


def add_command(commands: Any, name: str, help: str, doc: str | None, **options: Any) -> Any:
    """The parser of subcommand ``name`` (of the subparsers ``commands``' own parser class): ``help`` is its
    line in the list of commands, ``doc`` (a module docstring, or a sentence) its ``--help`` text, read with
    :func:`description`."""
    return commands.add_parser(name, help=help, description=description(doc), **options)


def description(doc: str | None) -> str:
    """A module docstring as ``--help`` text: its body after the summary line, without reST markup."""
    return (doc or "").split("\n\n", 1)[-1].replace("``", "")


#: The largest count a flag takes: torch and numpy sizes are int64 (past it, "Overflow when unpacking long long").
INT_MAX = 2**63 - 1


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text[:40]!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    if value > INT_MAX:
        raise argparse.ArgumentTypeError(f"must be a positive integer up to 2**63 - 1, got {text[:40]}")
    return value


#: ``torch.Generator.manual_seed``'s range (a seed outside it raised "Overflow when unpacking long long").
SEED_RANGE = (-(2**63), 2**64 - 1)


def seed(text: str) -> int:
    """An int that seeds a ``torch.Generator``: in :data:`SEED_RANGE`."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"must be an integer in [-2**63, 2**64 - 1], got {text[:40]!r}")
    return value


def utf8_text(flag: str, text: str) -> str:
    """``text`` if it is UTF-8: a command line's bytes that are not arrive as lone surrogates ("\\udcff"), which no
    tokenizer, JSON answer or file can hold; refused in one line naming ``flag``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UserError(f"{flag} must be UTF-8 text, got bytes that are not (a lone surrogate at character "
                        f"{err.start} of {text[:40]!r})") from None  # fmt: skip
    return text


def positive_float(text: str) -> float:
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
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
    return list(DTYPE_NAMES)


def device(text: str) -> "torch.device":
    """A torch device this process can use ("auto": the first CUDA device when there is one, else the CPU); a
    clear one-line error otherwise. Imports torch: call it in ``run``, after parsing, not as an argparse
    ``type``."""
    import torch

    from tlm_core.tensors import device_from_name

    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device_from_name(text, "--device")


#: The dtype inference runs in on each device type when ``--dtype`` is not given (None: the checkpoint's).
#: bf16 weights and KV cache on CUDA (as vLLM and litgpt do); a CPU keeps the checkpoint's float32, exact
#: against HF.
INFERENCE_DTYPE = {"cuda": "bfloat16"}


def inference_device(args: argparse.Namespace) -> "torch.device":
    """``--device`` read with :func:`device`, and ``args.dtype`` set to the device's default
    (:data:`INFERENCE_DTYPE`) when ``--dtype`` was not given; on CUDA float32 matmuls may use TF32
    (``torch.set_float32_matmul_precision("high")``)."""
    import torch

    chosen = device(args.device)
    if getattr(args, "dtype", None) is None:
        args.dtype = INFERENCE_DTYPE.get(chosen.type)
    if chosen.type == "cuda":
        torch.set_float32_matmul_precision("high")
    return chosen


def add_device_arguments(parser: argparse.ArgumentParser, dtype_help: str) -> None:
    """``--device`` (read with :func:`inference_device`, default "auto") and ``--dtype`` (one of
    :func:`dtype_choices`, default None: the device's, :data:`INFERENCE_DTYPE`)."""
    parser.add_argument(
        "--device", default="auto", help="torch device to run on (default: auto, CUDA when there is one, else cpu)"
    )
    parser.add_argument("--dtype", choices=dtype_choices(), default=None, help=f"{dtype_help}; bfloat16 on CUDA")


def check_output(out: str | os.PathLike[str], *inputs: str | os.PathLike[str] | None, flag: str = "--out") -> None:
    """An output must never overwrite, contain or sit inside an input: refuse before anything is written."""
    target = Path(out).resolve()
    for source in inputs:
        if source is None:
            continue
        given = Path(source).resolve()
        if target == given or given in target.parents or target in given.parents:
            raise UserError(f"{flag} {out} would overwrite the input {source}; choose another {flag}")


def fit_threads(device: "str | torch.device", *, quiet: bool = False) -> int:
    """Keep torch's CPU threads to the cores other processes leave free (``tlm_core.threads.fit_threads``),
    for a command computing on the CPU; says so in one line unless ``quiet``. Returns the threads used."""
    import torch

    if torch.device(device).type != "cpu":
        return int(torch.get_num_threads())
    from tlm_core.threads import fit_threads as choose

    choice = choose(torch.get_num_threads())
    if choice.threads != torch.get_num_threads():
        torch.set_num_threads(choice.threads)
    if choice.note is not None and not quiet:
        say(choice.note)
    return choice.threads


def damaged(step: int, error: Exception) -> None:
    say(f"checkpoint of step {step} is damaged ({str(error).splitlines()[0][:160]}); using the one before")
