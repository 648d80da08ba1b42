"""``tlm``: the parser of every subcommand, and the one place user errors become one line and exit 2.

Each subcommand is a module of this package, ``tlm_command.<name>``, with ``add_parser(commands)`` (which sets
``run=fn`` on its parser) and ``run(args) -> int``; ``sweep`` and ``compare`` call tlm-experiments. A command's
``UserError``, ``ValueError``, ``TypeError`` or ``OSError`` prints ``tlm: error: <first line>`` (at most 2,000
characters of it) and exits 2; Ctrl-C exits 130.
"""

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

from tlm_command.args import Parser, UserError

#: The subcommands, in the order ``tlm --help`` lists them; each is the module ``tlm_command.<name>``.
COMMANDS = ("train", "sweep", "compare", "generate", "eval", "convert", "tokenizer", "info", "accounting", "serve")


def _version() -> str:
    versions = []
    for dist in ("tlm-command", "tlm-model", "tlm-train", "tlm-tokenizer", "torch"):
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source checkout without metadata
            versions.append(f"{dist} (not installed)")
    return "tlm: " + ", ".join(versions)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tlm",
        description="tlm: train a Transformer language model from text, sample from it, evaluate it and move it "
        "to and from Hugging Face.",
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for name in COMMANDS:
        importlib.import_module(f"tlm_command.{name}").add_parser(commands)
    return parser


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:2000]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tlm`` command; returns its exit status. A user error prints one line and raises ``SystemExit(2)``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except (UserError, ValueError, TypeError, OSError) as err:
        if isinstance(err, OSError) and err.filename is not None and err.strerror:
            message = f"{err.strerror}: {err.filename}"
        else:
            message = _first_line(err)
        parser.exit(2, f"tlm: error: {message}\n")
    except ImportError as err:
        # An optional library a flag needs (compare --out: matplotlib; train --wandb: wandb): the packages' messages
        # say what to install. Any other ImportError is a broken install: its traceback is what to report.
        if "pip install" not in str(err):
            raise
        parser.exit(2, f"tlm: error: {_first_line(err)}\n")
    except KeyboardInterrupt:
        parser.exit(130, "tlm: interrupted\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
