"""``tlm compare``: tlm_experiments.compare's tables, JSON and figure on the command line."""

import argparse
import json
import os
import sys
from typing import Any

from tlm_command.args import UserError, add_command, check_output, positive_float
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


def run(args: argparse.Namespace) -> int:
    if args.out is not None:
        # The figure must never replace what the comparison reads (a run's metrics.jsonl) or a folder.
        check_output(args.out, *args.paths)
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
