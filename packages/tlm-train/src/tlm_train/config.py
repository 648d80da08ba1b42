"""The training run's settings as one flat dataclass, read from TOML and/or flags, saved as TOML.

A run directory holds ``train.toml``: ``tlm train --config RUN_DIR/train.toml`` repeats the run,
and ``tlm train --resume RUN_DIR`` reads it back to continue. Every field has a default, so an
empty config trains the small default model on the default corpus (see :mod:`tlm_train.corpus`).
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

from tlm_model import PRESETS, ModelConfig

CONFIG_NAME = "train.toml"
DISTRIBUTED_MODES = ("none", "ddp", "fsdp")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class TrainConfig:
    """Everything a run needs. Sizes are global: ``batch_size`` sequences per optimizer step over
    all ranks and ``grad_accum`` micro-steps together, so a run gives the same batches (and, up to
    float reassociation, the same weights) on 1 process or N."""

    # Output.
    out_dir: str = "runs/default"
    # Data: text files (a tokenizer is trained or loaded), or one token-id file (.npy, or raw
    # .bin/.u16/.u32 with ``token_dtype``). None: the default corpus, which needs no download.
    data: list[str] = field(default_factory=list)
    token_dtype: str = "uint16"
    val_fraction: float = 0.1
    tokenizer: str | None = None  # a Tokenizer.save directory to load instead of training one
    vocab_size: int = 1024
    special_tokens: list[str] = field(default_factory=lambda: ["<|endoftext|>"])
    # Model: a preset name, or the dimensions below (vocab_size comes from the tokenizer/data).
    preset: str | None = None
    context_length: int = 128
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    d_ff: int = 384
    rope_theta: float = 10_000.0
    # Optimizer and schedule (AdamW; linear warm-up then cosine to min_lr).
    lr: float = 3e-3
    min_lr: float | None = None  # None: lr / 10
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
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
    # The sample printed at the end.
    sample_prompt: str = "The "
    sample_tokens: int = 64
    sample_temperature: float = 0.8

    def __post_init__(self) -> None:
        positive: tuple[str, ...]
        positive = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff", "batch_size")
        positive += ("grad_accum", "steps", "eval_interval", "eval_batches", "log_interval", "checkpoint_interval")
        positive += ("keep_checkpoints",)
        for name in positive:
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("warmup_steps", self.warmup_steps, minimum=0)
        _check_int("sample_tokens", self.sample_tokens, minimum=0)
        _check_int("seed", self.seed, minimum=0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        if self.min_lr is None:
            self.min_lr = self.lr / 10
        for name in ("lr", "min_lr", "beta1", "beta2", "eps", "weight_decay", "grad_clip", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"TrainConfig.{name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {value}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"TrainConfig.val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"TrainConfig.min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if isinstance(self.data, str):
            self.data = [self.data]
        if not isinstance(self.data, list) or not all(isinstance(p, str) for p in self.data):
            raise TypeError(f"TrainConfig.data must be a list of paths, got {self.data!r}")
        if self.token_dtype not in ("uint16", "uint32"):
            raise ValueError(f"TrainConfig.token_dtype must be 'uint16' or 'uint32', got {self.token_dtype!r}")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"TrainConfig.preset must be one of {sorted(PRESETS)} or None, got {self.preset!r}")
        if self.distributed not in DISTRIBUTED_MODES:
            raise ValueError(f"TrainConfig.distributed must be one of {DISTRIBUTED_MODES}, got {self.distributed!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.peak_flops is not None and not (isinstance(self.peak_flops, (int, float)) and self.peak_flops > 0):
            raise ValueError(f"TrainConfig.peak_flops must be a positive number or None, got {self.peak_flops!r}")

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The model's shape: the preset's (with the data's vocabulary), or the dimensions here."""
        if self.preset is not None:
            return dataclasses.replace(ModelConfig.from_preset(self.preset), vocab_size=vocab_size)
        return ModelConfig(
            vocab_size=vocab_size,
            context_length=self.context_length,
            d_model=self.d_model,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            d_ff=self.d_ff,
            rope_theta=float(self.rope_theta),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown training settings {unknown}; expected a subset of {sorted(names)}")
        return cls(**data)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> "TrainConfig":
        """Read a TOML file of ``key = value`` lines (top-level keys are the field names);
        ``overrides`` (e.g. from command-line flags) win over the file."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path} is not valid TOML: {err}") from err
        return cls.from_dict({**data, **overrides})

    def to_toml(self) -> str:
        lines = ["# tlm train settings: `tlm train --config this-file` repeats the run."]
        for key, value in self.to_dict().items():
            if value is not None:  # TOML has no null: an absent key reads back as the default None
                lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"TrainConfig.{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"TrainConfig.{name} must be >= {minimum}, got {value}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
