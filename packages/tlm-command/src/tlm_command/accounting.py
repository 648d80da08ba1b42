"""``tlm accounting``: parameters, memory and FLOPs of a preset, shares across presets, per-rank training memory."""

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from tlm_command.args import UserError, add_command, positive_int
from tlm_model.accounting import account, compare_text
from tlm_model.config import PRESETS, ModelConfig


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "accounting",
        "parameters, memory and FLOPs of a preset, or component shares across presets",
        "Analytic accounting: exact parameter and matmul FLOP counts, elementwise work as an estimate.",
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--preset", choices=sorted(PRESETS), help="report one preset in full")
    which.add_argument(
        "--compare",
        nargs="+",
        choices=sorted(PRESETS),
        metavar="PRESET",
        help="compare the FLOP shares of several presets side by side",
    )
    parser.add_argument(
        "--context-length",
        type=positive_int,
        metavar="N",
        help="sequence length to account for (default: the preset's context length)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=1, metavar="B", help="sequences per batch")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--world-size",
        type=positive_int,
        metavar="N",
        help="also report per-rank training memory under DDP and FSDP2 at N ranks",
    )
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="with --world-size: per-block activation checkpointing"
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", help="also draw the FLOP shares as stacked bars (needs matplotlib)"
    )
    parser.set_defaults(run=run)


def _check_plot_target(path: str) -> None:
    """Everything --plot needs, checked before any work: matplotlib, the folder, the format."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'tlm-command[plot]' (or matplotlib)") from None
    if not path:
        raise UserError("--plot is empty; name the image file to write")
    if os.path.isdir(path):
        raise UserError(f"--plot {path} is a folder; name the image file to write")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"--plot {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UserError(f"--plot {path}: the folder {folder} is not writable")
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise UserError(f"--plot {path}: unknown image format {suffix!r}; expected one of {sorted(formats)}")


def run(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.compare:
        raise UserError("--world-size reports one model: use it with --preset, not --compare")
    if args.activation_checkpointing and args.world_size is None:
        raise UserError("--activation-checkpointing applies to the training memory: give --world-size N too")
    if args.plot is not None:  # --plot '' too: asked for, so never silently skipped
        _check_plot_target(args.plot)
    names = args.compare or [args.preset]
    reports = []
    for name in names:
        cfg = ModelConfig.from_preset(name)
        if args.context_length is not None:
            cfg = dataclasses.replace(cfg, context_length=args.context_length)
        reports.append((name, account(cfg, batch_size=args.batch_size, seq_len=cfg.context_length)))
    memory = None
    if args.world_size is not None:
        from tlm_train.memory import train_memory

        memory = [
            train_memory(
                reports[0][1].config,
                mode=mode,
                world_size=args.world_size,
                batch_size=args.batch_size,
                activation_checkpointing=args.activation_checkpointing,
            )
            for mode in ("ddp", "fsdp")
        ]
    if args.json:
        payload = {name: report.to_dict() for name, report in reports}
        single = payload[names[0]]
        if memory is not None:
            single["training_memory_per_rank"] = {m.mode: {**dataclasses.asdict(m), "total": m.total} for m in memory}
        print(json.dumps(payload if args.compare else single, indent=2))
    elif args.compare:
        print(compare_text(reports))
    else:
        print(reports[0][1].to_text(reports[0][0]))
        if memory is not None:
            from tlm_train.memory import memory_table

            print("\n" + memory_table(memory))
    if args.plot:
        from tlm_model.plot import plot_shares

        plot_shares(reports, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
