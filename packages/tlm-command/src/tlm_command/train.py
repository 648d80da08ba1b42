"""``tlm train``: text to a tokenizer, a trained model and a sample, in one run folder.

Every setting is a flag, read over ``--config FILE.toml``; the model starts from ``--preset`` and any
of its fields can be set (``--num-kv-heads 2 --tie-word-embeddings``); ``--init-from X`` fine-tunes X
(a run, a checkpoint or an HF Llama folder) instead. ``--resume RUN`` continues a run from its newest
checkpoint that verifies (``--resume RUN/checkpoints/step_N``: from that step) with its saved settings,
over which flags apply from the resumed step on (learning rate, schedule, steps, intervals...); a flag
that would change the model, data, tokenizer or seed is refused before anything is written.

Scale-out is torchrun's (the same command on every rank; rank 0 writes the files):

    torchrun --nproc-per-node 2 -m tlm train --distributed fsdp      # one machine, gloo on CPU
"""

import argparse
import dataclasses
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from tlm_command.args import UserError, description
from tlm_model import PRESETS
from tlm_model.config import FFN_KINDS, NORM_PLACEMENTS, POSITIONS, ModelConfig
from tlm_model.config import FIELDS as MODEL_FIELDS
from tlm_train.config import DISTRIBUTED_MODES, DTYPES, TOKEN_DTYPES, TrainConfig

_HELP = {
    "out_dir": "the run folder: train.toml, tokenizer/, data/, metrics.jsonl, loss.png, checkpoints/",
    "data": "text files (encoded with the run's tokenizer) or one token-id file (.npy, .bin); "
    "none: Python's own pydoc topics, no download",
    "token_dtype": "the id type of a raw token file (.bin, .u16, .u32)",
    "val_fraction": "share of the tokens held out for validation (the end of the data)",
    "tokenizer": "a tokenizer folder to use instead of training one",
    "vocab_size": "vocabulary of the tokenizer to train (or the id range of a token file)",
    "special_tokens": "special tokens of the tokenizer to train",
    "init_from": "fine-tune: start from this run, checkpoint or HF Llama folder (its weights, shape and tokenizer)",
    "preset": "the model to start from (the [model] flags below change its fields)",
    "lr": "peak learning rate (AdamW)",
    "min_lr": "the cosine schedule's floor (default: lr / 10)",
    "beta1": "AdamW β1",
    "beta2": "AdamW β2",
    "eps": "AdamW ε",
    "weight_decay": "decoupled weight decay of the matrices",
    "decay_norms": "also decay 1-D parameters (RMSNorm gains)",
    "warmup_steps": "linear warm-up steps before the cosine decay",
    "grad_clip": "clip the global gradient L2 norm to this (0: off)",
    "batch_size": "sequences per optimizer step, over all ranks and accumulation steps",
    "grad_accum": "micro-batches per optimizer step",
    "steps": "optimizer steps",
    "max_tokens": "a token budget instead of --steps",
    "eval_interval": "steps between validation losses",
    "eval_batches": "validation batches per evaluation",
    "log_interval": "steps between logged training losses (each log reads the device)",
    "checkpoint_interval": "steps between checkpoints",
    "keep_checkpoints": "checkpoints kept (the newest always)",
    "device": "cpu, cuda, cuda:1, mps, ...",
    "dtype": "autocast dtype for forward/backward (bfloat16 on GPUs; float16 adds loss scaling); weights stay float32",
    "compile": "torch.compile each block",
    "seed": "seeds the weights, the batches and every RNG",
    "deterministic": "deterministic kernels (bit-exact resume)",
    "distributed": "under torchrun: ddp or fsdp (FSDP2, fully_shard per block)",
    "activation_checkpointing": "recompute each block's activations in the backward pass",
    "peak_flops": "the device's FLOP/s for MFU (default: measured with a float32 GEMM at start-up)",
    "tensorboard": "also write TensorBoard event files to RUN/tensorboard/ (pip install 'tlm-train[tensorboard]')",
    "sample_prompt": "the prompt of the sample printed at the end",
    "sample_tokens": "tokens of the sample printed at the end (0: none)",
    "sample_temperature": "temperature of the sample printed at the end",
}
_MODEL_HELP = {
    "context_length": "tokens per training window, and the model's context",
    "d_model": "width of the residual stream",
    "num_layers": "Transformer blocks",
    "num_heads": "query heads",
    "d_ff": "FFN hidden width",
    "rope_theta": "RoPE base",
    "norm_eps": "RMSNorm epsilon",
    "num_kv_heads": "key/value heads (fewer than --num-heads: grouped-query attention)",
    "head_dim": "per-head width (default d_model / num_heads)",
    "tie_word_embeddings": "the LM head reuses the token embedding matrix",
    "rope_scaling": 'RoPE scaling as JSON, e.g. \'{"rope_type": "linear", "factor": 2.0}\'',
    "rope_layout": "RoPE pairing: interleaved (the course's) or half (HF's rotate-half)",
    "norm_placement": "where RMSNorm goes: pre (the course's), post (norm(x + sublayer(x))) or none (nowhere, "
    "the final norm included)",
    "positions": "rope, or none (NoPE: only the causal mask carries position)",
    "ffn": "swiglu (W2(SiLU(W1·x) ⊙ W3·x)) or silu (W2·SiLU(W1·x); the course's width: --d-ff 4·d_model)",
}
_CHOICES = {
    "distributed": DISTRIBUTED_MODES,
    "dtype": DTYPES,
    "token_dtype": TOKEN_DTYPES,
    "preset": sorted(PRESETS),
    "rope_layout": ("interleaved", "half"),
    "norm_placement": NORM_PLACEMENTS,
    "positions": POSITIONS,
    "ffn": FFN_KINDS,
}
_MODEL_FLAGS = [name for name in MODEL_FIELDS if name != "vocab_size"]  # the vocabulary is the tokenizer's


def _flag_type(annotation: Any) -> tuple[Any, bool]:
    """(scalar type, is_list) of a field annotation such as ``int | None`` or ``list[str]``."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"list": list, "dict": dict, "Any": Any})  # annotations are plain builtins
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        return args[0], True
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0], False
    return annotation, False


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({err.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _add(parser: Any, name: str, annotation: Any, default: str, help_text: str, dest: str) -> None:
    kind, is_list = _flag_type(annotation)
    flag = "--" + name.replace("_", "-")
    common: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": f"{help_text} (default: {default})"}
    if kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
    elif kind is dict or typing.get_origin(kind) is dict:
        parser.add_argument(flag, type=_json_object, metavar="JSON", **common)
    else:
        metavar = "FILE" if name == "data" else name.upper()
        choices = _CHOICES.get(name)
        parser.add_argument(
            flag,
            type=kind,
            nargs="+" if is_list else None,
            metavar=None if choices else metavar,
            choices=choices,
            **common,
        )


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "train",
        help="train a tokenizer and a model (default data needs no download); fine-tune with --init-from",
        description=description(__doc__),
    )
    parser.add_argument("--config", metavar="FILE.toml", help="settings file (flags override it)")
    parser.add_argument("--resume", metavar="RUN", help="continue a run folder (or a step folder of one)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no log lines")
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        if field.name == "model":
            continue
        default = getattr(defaults, field.name)
        shown = (
            "none" if default in (None, []) else " ".join(map(str, default)) if isinstance(default, list) else default
        )
        _add(parser, field.name, field.type, str(shown), _HELP[field.name], field.name)
    model = parser.add_argument_group("model (the [model] table: fields over --preset; defaults are the preset's)")
    for field in dataclasses.fields(ModelConfig):
        if field.name in _MODEL_FLAGS:
            _add(model, field.name, field.type, "the preset's", _MODEL_HELP[field.name], f"model.{field.name}")
    parser.set_defaults(run=run)


def _settings(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    values = vars(args)
    train = {f.name: values[f.name] for f in dataclasses.fields(TrainConfig) if f.name in values and f.name != "model"}
    model = {name: values[f"model.{name}"] for name in _MODEL_FLAGS if f"model.{name}" in values}
    return train, model


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, int | None, bool]:
    """The run's settings (the saved ones for ``--resume``, then ``--config``, then flags), the step to resume
    from (None: the newest), and whether to resume."""
    overrides, model = _settings(args)
    if model:
        overrides["model"] = model
    if args.resume is not None:
        from tlm_train.run_dir import RunDir

        if args.config is not None:
            raise UserError("--resume continues with the run's own train.toml; --config does not apply to it")
        run, step = _resume_target(Path(args.resume))
        if "out_dir" in overrides and Path(overrides["out_dir"]).resolve() != run.resolve():
            raise UserError(f"--out-dir {overrides['out_dir']} differs from the run being resumed ({run})")
        overrides["out_dir"] = str(run)
        return RunDir(run).read_config(**overrides), step, True
    if args.config is not None:
        if not Path(args.config).is_file():
            raise FileNotFoundError(f"--config {args.config}: no such file")
        return TrainConfig.from_toml(args.config, **overrides), None, False
    return TrainConfig(**overrides), None, False


def _resume_target(path: Path) -> tuple[Path, int | None]:
    from tlm_train.checkpoint import CheckpointManager
    from tlm_train.run_dir import CHECKPOINT_DIR, RunDir

    match = CheckpointManager.PATTERN.fullmatch(path.name)
    if match and path.parent.name == CHECKPOINT_DIR and RunDir.is_run(path.parent.parent):
        return path.parent.parent, int(match.group(1))
    if not RunDir.is_run(path):
        raise UserError(f"--resume {path}: not a tlm train run folder (no train.toml or checkpoints/ in it)")
    return path, None


def _flags(message: str) -> str:
    """Settings named as the user typed them: ``TrainConfig.min_lr`` -> ``--min-lr``."""
    message = re.sub(r"TrainConfig\.model: ModelConfig\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), message)
    message = re.sub(r"(?:TrainConfig|ModelConfig)\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), message)
    return message


def _log(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"tlm: {line}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from tlm_train import NonFiniteLossError, RunInUseError, train

    try:
        config, step, resume = config_from_args(args)
    except (TypeError, ValueError) as err:
        raise type(err)(_flags(str(err))) from None
    try:
        result = train(
            config,
            resume=resume,
            resume_from=step,
            log=None if args.quiet else _log,
            progress=False if args.quiet else None,
        )
    except RunInUseError as err:
        raise UserError(str(err)) from None
    except NonFiniteLossError as err:
        print(f"tlm: error: {err}", file=sys.stderr)
        return 1
    except (TypeError, ValueError) as err:
        raise type(err)(_flags(str(err))) from None
    if result.sample is not None and not args.quiet:
        _log(f"run folder: {result.run_dir}")
        print("sample:", result.sample.replace("\n", "\n        "))
    return 130 if result.interrupted else 0
