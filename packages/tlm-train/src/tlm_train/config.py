"""The training run's settings: one dataclass, read from TOML and/or flags, saved as ``RUN/train.toml``.

The model is not copied here: ``preset`` names a :data:`tlm_model.PRESETS` entry as the starting point
and ``model`` (the ``[model]`` table in TOML) overrides any :class:`tlm_model.ModelConfig` field, so a
new model field is a training setting with no edit here. The run writes the resolved model (every
field, the vocabulary taken from the tokenizer) back into ``train.toml``, which therefore records what
ran. Every field has a default: an empty config trains the ``tiny`` preset on the default corpus.
"""

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import tomli_w

from tlm_core.checks import check_bool, check_choice, check_int, check_number
from tlm_model import PRESETS, ModelConfig
from tlm_model.config import FIELDS as MODEL_FIELDS

CONFIG_NAME = "train.toml"
DISTRIBUTED_MODES = ("none", "ddp", "fsdp")
DTYPES = ("float32", "bfloat16", "float16")
TOKEN_DTYPES = ("uint16", "uint32")


@dataclass
class TrainConfig:
    """Everything a run needs. Sizes are global: ``batch_size`` sequences per optimizer step over
    all ranks and ``grad_accum`` micro-steps together, so a run gives the same batches (and, up to
    float reassociation, the same weights) on 1 process or N."""

    # Output.
    out_dir: str = "runs/default"
    # Data: text files (encoded with the run's tokenizer), or one token-id file (.npy, or raw
    # .bin/.u16/.u32 with ``token_dtype``). Empty: the default corpus, which needs no download.
    data: list[str] = field(default_factory=list)
    token_dtype: str = "uint16"
    val_fraction: float = 0.1
    tokenizer: str | None = None  # a tokenizer folder to use instead of training one
    vocab_size: int = 1024  # the vocabulary to train a tokenizer to (or the id range of a token file)
    special_tokens: list[str] = field(default_factory=lambda: ["<|endoftext|>"])
    # Model: start from `init_from`'s weights and shape, or from `preset` with `model` overriding fields.
    init_from: str | None = None
    preset: str = "tiny"
    model: dict[str, Any] = field(default_factory=dict)
    # Optimizer and schedule (AdamW; linear warm-up then cosine to min_lr).
    lr: float = 3e-3
    min_lr: float | None = None  # None: lr / 10
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_norms: bool = False  # weight decay on 1-D parameters (RMSNorm gains) too
    warmup_steps: int = 20
    grad_clip: float = 1.0  # 0 disables clipping
    # Steps and batches.
    batch_size: int = 16
    grad_accum: int = 1
    steps: int = 300
    max_tokens: int | None = None  # a token budget: stops once this many tokens were trained on
    eval_interval: int = 50
    eval_batches: int = 8
    log_interval: int = 1
    checkpoint_interval: int = 100
    keep_checkpoints: int = 2
    # Execution.
    device: str = "cpu"
    dtype: str = "float32"  # autocast dtype for forward/backward; weights and optimizer stay float32
    compile: bool = False
    seed: int = 0
    deterministic: bool = True
    distributed: str = "none"  # "ddp" or "fsdp" under torchrun
    activation_checkpointing: bool = False
    peak_flops: float | None = None  # FLOP/s for MFU; None measures a float32 GEMM at start-up
    tensorboard: bool = False  # also log to TensorBoard event files in RUN/tensorboard/ (metrics.jsonl always)
    # The sample printed at the end.
    sample_prompt: str = "The "
    sample_tokens: int = 64
    sample_temperature: float = 0.8

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum", "steps", "eval_interval", "eval_batches", "log_interval"):
            check_int(f"TrainConfig.{name}", getattr(self, name), low=1)
        for name in ("checkpoint_interval", "keep_checkpoints", "vocab_size"):
            check_int(f"TrainConfig.{name}", getattr(self, name), low=1)
        for name in ("warmup_steps", "sample_tokens", "seed"):
            check_int(f"TrainConfig.{name}", getattr(self, name), low=0)
        if self.max_tokens is not None:
            check_int("TrainConfig.max_tokens", self.max_tokens, low=1)
        check_number("TrainConfig.lr", self.lr, low=0.0, low_open=True)
        if self.min_lr is not None:
            check_number("TrainConfig.min_lr", self.min_lr, low=0.0, high=self.lr)
        for name in ("beta1", "beta2"):
            check_number(f"TrainConfig.{name}", getattr(self, name), low=0.0, high=1.0, high_open=True)
        check_number("TrainConfig.eps", self.eps, low=0.0, low_open=True)
        check_number("TrainConfig.weight_decay", self.weight_decay, low=0.0)
        if self.lr * self.weight_decay >= 1:
            # Decoupled decay multiplies every weight by 1 - lr·weight_decay each step: <= 0 flips or zeroes it.
            raise ValueError(
                f"TrainConfig.lr × weight_decay must be < 1 (each step scales the weights by 1 - lr·weight_decay), "
                f"got lr={self.lr:g}, weight_decay={self.weight_decay:g}"
            )
        check_number("TrainConfig.grad_clip", self.grad_clip, low=0.0)
        check_number("TrainConfig.val_fraction", self.val_fraction, low=0.0, high=1.0, low_open=True, high_open=True)
        check_number("TrainConfig.sample_temperature", self.sample_temperature, low=0.0)
        if self.peak_flops is not None:
            check_number("TrainConfig.peak_flops", self.peak_flops, low=0.0, low_open=True)
        for name in ("decay_norms", "compile", "deterministic", "activation_checkpointing", "tensorboard"):
            check_bool(f"TrainConfig.{name}", getattr(self, name))
        for name in ("out_dir", "token_dtype", "preset", "device", "dtype", "distributed", "sample_prompt"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"TrainConfig.{name} must be a str, got {type(getattr(self, name)).__name__}")
        for name in ("tokenizer", "init_from"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"TrainConfig.{name} must be a path (str) or None, got {getattr(self, name)!r}")
        if isinstance(self.data, str):
            self.data = [self.data]
        for name in ("data", "special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
                raise TypeError(f"TrainConfig.{name} must be a list of non-empty strings, got {value!r}")
        check_choice("TrainConfig.token_dtype", self.token_dtype, TOKEN_DTYPES)
        check_choice("TrainConfig.preset", self.preset, sorted(PRESETS))
        check_choice("TrainConfig.distributed", self.distributed, DISTRIBUTED_MODES)
        check_choice("TrainConfig.dtype", self.dtype, DTYPES)
        _check_device(self.device)
        if not isinstance(self.model, dict):
            raise TypeError(f"TrainConfig.model must be a table of ModelConfig fields, got {self.model!r}")
        if unknown := sorted(set(self.model) - set(MODEL_FIELDS)):
            raise ValueError(f"TrainConfig.model has unknown fields {unknown}; ModelConfig has {list(MODEL_FIELDS)}")
        self.model_config()  # every field's type and range and every cross-field rule, checked now
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"TrainConfig.batch_size ({self.batch_size}) must split evenly into grad_accum ({self.grad_accum}) "
                "micro-batches"
            )

    @property
    def final_min_lr(self) -> float:
        """The schedule's floor: ``min_lr``, or ``lr / 10`` when it is None."""
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The model's shape: the preset with ``model``'s fields over it, and ``vocab_size`` (the
        tokenizer's) unless ``model`` sets one, which must then agree."""
        fields = {**PRESETS[self.preset].to_dict(), **self.model}
        if vocab_size is not None:
            if "vocab_size" in self.model and self.model["vocab_size"] != vocab_size:
                raise ValueError(
                    f"TrainConfig.model.vocab_size is {self.model['vocab_size']} but the tokenizer/data has "
                    f"{vocab_size} ids; leave [model] vocab_size out to take the tokenizer's"
                )
            fields["vocab_size"] = vocab_size
        try:
            return ModelConfig.from_dict(fields)
        except (TypeError, ValueError) as err:
            raise type(err)(f"TrainConfig.model: {err}") from None

    def total_steps(self) -> int:
        """``steps``, or the steps that a token budget (``max_tokens``) takes."""
        if self.max_tokens is None:
            return self.steps
        return math.ceil(self.max_tokens / (self.batch_size * self.model_config().context_length))

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(data) - names):
            raise ValueError(f"unknown training settings {unknown}; expected a subset of {sorted(names)}")
        return cls(**data)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> "TrainConfig":
        """Read a TOML file (top-level keys are the field names, the model a ``[model]`` table);
        ``overrides`` (e.g. from command-line flags) win over the file, ``model`` key by key."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path} is not valid TOML: {err}") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"{path} is not UTF-8 text: {err}") from None
        if "model" in overrides and isinstance(data.get("model", {}), dict):
            overrides = {**overrides, "model": {**data.get("model", {}), **overrides["model"]}}
        merged = {**data, **overrides}
        try:
            return cls.from_dict(merged)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{path}: {err}") from None

    def to_toml(self) -> str:
        """TOML that :meth:`from_toml` reads back to an equal config (None fields are left out: TOML has no null)."""
        data = {k: v for k, v in self.to_dict().items() if v is not None and k != "model"}
        data["model"] = {k: v for k, v in self.model.items() if v is not None}
        header = "# tlm train settings: `tlm train --config this-file` repeats the run.\n"
        return header + tomli_w.dumps(data)


def _check_device(name: str) -> None:
    import torch

    try:
        torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"TrainConfig.device must be a torch device such as cpu, cuda or cuda:1, got {name!r}"
        ) from None
