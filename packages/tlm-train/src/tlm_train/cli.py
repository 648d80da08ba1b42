"""``tlm train``: the command (a ``tlm.cli`` plugin) and ``python -m tlm_train train``.

Every :class:`~tlm_train.config.TrainConfig` field is a flag (``--batch-size 16``, ``--no-deterministic``),
read over ``--config FILE.toml``; ``--resume RUN_DIR`` continues a run with its saved settings.

Scale-out is torchrun's (the same command on every rank; rank 0 writes the files)::

    torchrun --nproc-per-node 2 -m tlm_train train --distributed fsdp       # one machine, gloo on CPU
    # several machines (standard c10d rendezvous; run on every node; OUT_DIR on a filesystem all share):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id RUN \
        -m tlm_train train --distributed fsdp --device cuda --dtype bfloat16 --out-dir OUT_DIR
"""

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

from tlm_train.config import CONFIG_NAME, DISTRIBUTED_MODES, DTYPES, TrainConfig

_HELP = {
    "out_dir": "run directory: train.toml, metrics.jsonl, loss.png, checkpoints/ (default runs/default)",
    "data": "text files (a tokenizer is trained on them) or one token-id file (.npy, .bin); "
    "default: Python's own pydoc topics, no download",
    "tokenizer": "a saved tokenizer directory to use instead of training one",
    "vocab_size": "tokenizer vocabulary size to train (or the id range of a token file)",
    "preset": "a tlm model preset (default: the small model set by --d-model, --num-layers, ...)",
    "steps": "optimizer steps",
    "max_tokens": "a token budget instead of --steps",
    "batch_size": "sequences per optimizer step, over all ranks and accumulation steps",
    "grad_accum": "micro-batches per optimizer step",
    "grad_clip": "clip the global gradient L2 norm to this (0: off)",
    "dtype": "autocast dtype for forward/backward (bfloat16 on GPUs); weights stay float32",
    "distributed": "under torchrun: ddp or fsdp (FSDP2, fully_shard per block)",
    "activation_checkpointing": "recompute each block's activations in the backward pass",
    "device": "cpu, cuda, ...",
    "compile": "torch.compile each block",
}
_CHOICES = {"distributed": DISTRIBUTED_MODES, "dtype": DTYPES, "token_dtype": ("uint16", "uint32")}


def _flag_type(annotation: Any) -> tuple[Any, bool]:
    """(scalar type, is_list) of a field annotation such as ``int | None`` or ``list[str]``."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"list": list})  # annotations are plain builtins here
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        return args[0], True
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0], False
    return annotation, False


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="settings file (flags override it)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its newest checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no log lines")
    for field in dataclasses.fields(TrainConfig):
        kind, is_list = _flag_type(field.type)
        flag = "--" + field.name.replace("_", "-")
        common: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS, "help": _HELP.get(field.name)}
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        else:
            metavar = "FILE" if field.name == "data" else field.name.upper()
            parser.add_argument(flag, type=kind, nargs="+" if is_list else None, metavar=metavar,
                                choices=_CHOICES.get(field.name), **common)  # fmt: skip


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, bool]:
    """The run's settings (saved ones for ``--resume``, then ``--config``, then flags) and whether
    to resume."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    overrides = {name: getattr(args, name) for name in names if hasattr(args, name)}
    if args.resume is not None:
        saved = Path(args.resume) / CONFIG_NAME
        if not saved.is_file():
            raise FileNotFoundError(f"--resume {args.resume}: no {CONFIG_NAME} there, so it is not a tlm train run")
        overrides["out_dir"] = str(args.resume)
        return TrainConfig.from_toml(saved, **overrides), True
    if args.config is not None:
        if not Path(args.config).is_file():
            raise FileNotFoundError(f"--config {args.config}: no such file")
        return TrainConfig.from_toml(args.config, **overrides), False
    return TrainConfig(**overrides), False


def run_command(args: argparse.Namespace) -> int:
    from tlm_train.run import train
    from tlm_train.trainer import NonFiniteLossError

    config, resume = config_from_args(args)
    log = None if args.quiet else _log
    try:
        result = train(config, resume=resume, log=log, progress=False if args.quiet else None)
    except NonFiniteLossError as err:
        print(f"tlm train: {err}", file=sys.stderr)
        return 1
    if result.sample is not None and not args.quiet:
        _log(f"run directory: {result.run_dir}")
        print("sample:", result.sample.replace("\n", "\n        "))
    return 130 if result.interrupted else 0


def _log(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)


def register(subparsers: Any) -> None:
    """The ``tlm.cli`` plugin hook: adds ``train`` to the ``tlm`` command."""
    parser = subparsers.add_parser(
        "train",
        help="train a tokenizer and a model (default data needs no download); resume with --resume RUN_DIR",
        description="Train a TransformerLM. Under torchrun, --distributed ddp|fsdp runs on every rank.",
    )
    add_train_arguments(parser)
    parser.set_defaults(handler=run_command)


def main(argv: list[str] | None = None) -> int:
    """``python -m tlm_train train ...``: the same command without the ``tlm`` entry point."""
    parser = argparse.ArgumentParser(prog="python -m tlm_train")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, TypeError, OSError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
