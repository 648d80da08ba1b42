"""``tlm compare``: tlm_experiments.compare's tables, JSON and figure on the command line."""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tlm_command.args import UserError, add_command, positive_float
from tlm_experiments import compare
from tlm_experiments.results import UNSTABLE_ABOVE


def add_result_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that read runs as results, shared by ``tlm sweep`` and ``tlm compare``: ``--unstable-above``
    and ``--baseline``."""
    parser.add_argument(
        "--unstable-above", type=positive_float, default=UNSTABLE_ABOVE, metavar="X",
        help=f"a finished run is unstable when an evaluation exceeded X × its first (default: {UNSTABLE_ABOVE})",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", metavar="SETTING", help="the setting compared against (default: baseline, else the first)"
    )


def add_parser(commands: Any) -> None:
    what = "put runs (or a sweep's runs) side by side: a table, and validation loss by step and by time"
    parser = add_command(commands, "compare", what, compare.__doc__)
    parser.add_argument("paths", nargs="+", metavar="RUN_OR_SWEEP", help="run folders, or sweep folders")
    parser.add_argument("--out", metavar="FILE.png", help="draw the comparison into this PNG")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    add_result_arguments(parser)
    parser.set_defaults(run=run)


def check_plot_out(out: str, paths: list[str]) -> None:
    """--out must not replace what compare reads: an input, a folder holding one, or a file already inside one
    (its metrics.jsonl, train.toml, a checkpoint). A new file there, or the PNG of an earlier compare, may be."""
    target = Path(out).resolve()
    for source in paths:
        given = Path(source).resolve()
        inside = given in target.parents and target.exists() and target.suffix.lower() != ".png"
        if target == given or target in given.parents or inside:
            raise UserError(f"--out {out} would overwrite the input {source}; choose another --out")


def run(args: argparse.Namespace) -> int:
    if args.out is not None:
        check_plot_out(args.out, args.paths)
        if os.path.isdir(args.out):
            raise UserError(f"--out {args.out} is a folder; name the PNG file to write")
    summaries = compare.collect(args.paths, unstable_above=args.unstable_above)
    if not summaries:
        raise UserError("no run to compare: the sweep folders hold no run that has started")
    unit = compare.harmonize(summaries)  # refuses runs validated on other text; bits per byte across tokenizers
    if unit != compare.NATS:
        print("tlm: the runs' tokenizers differ: their losses are compared in bits per byte", file=sys.stderr)
    text = compare.full_markdown(summaries, baseline=args.baseline, unit=unit)  # checks --baseline first
    if args.out is not None:
        compare.plot(summaries, args.out, title=None if unit == compare.NATS else "validation loss in bits per byte")
    if args.json:
        data = compare.report(summaries, unstable_above=args.unstable_above, baseline=args.baseline, unit=unit)
        print(json.dumps(data, indent=2, allow_nan=False))
    else:
        sys.stdout.write(text)
    return 0
