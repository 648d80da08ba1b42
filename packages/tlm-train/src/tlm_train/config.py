"""The training run's settings: one dataclass, read from TOML and/or flags, saved as ``RUN/train.toml``.

The model is not copied here: ``preset`` names a :data:`tlm_model.PRESETS` entry as the starting point
and ``model`` (the ``[model]`` table in TOML) overrides any :class:`tlm_model.ModelConfig` field, so a
new model field is a training setting with no edit here. The run writes the resolved model (every
field, the vocabulary taken from the tokenizer) back into ``train.toml``, which therefore records what
ran. Every field has a default: an empty config trains the ``tiny`` preset on the default corpus.

One field follows another: a ``[model]`` table that changes ``ffn`` from the preset's and leaves ``d_ff``
out gets the course's width for that kind at the model's ``d_model``
(``tlm_ffn.default_d_ff(d_model, kind=ffn)``: 4·d_model for ``silu``), not the preset's width for the
other kind. Nothing else is re-derived: a ``d_model`` alone keeps the preset's ``d_ff``.
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

from tlm_artifacts.layout import CONFIG_NAME as CONFIG_NAME  # a run's settings file (the layout's name)
from tlm_core.atomic import read_input
from tlm_core.checks import check_bool, check_choice, check_int, check_number, rephrased, short_repr
from tlm_ffn.options import default_d_ff
from tlm_lora.roles import check_targets
from tlm_model.config import FIELDS as MODEL_FIELDS
from tlm_model.config import PRESETS, ModelConfig
from tlm_rope.options import RULE_NAMES, check_scaling
from tlm_tokenizer.chat import TRAIN_ON

DISTRIBUTED_MODES = ("none", "ddp", "fsdp")
#: The default log_interval: every step on the CPU (a read costs little there); on an accelerator each logging
#: step waits for the device, so one step in ten (torchtitan's default log frequency).
LOG_INTERVAL_CPU, LOG_INTERVAL_ACCELERATOR = 1, 10
DTYPES = ("float32", "bfloat16", "float16")
TOKEN_DTYPES = ("uint16", "uint32")
CHAT_LAYOUTS = ("packed", "padded")
LOGGER_ERRORS = ("stop", "warn")


#: Settings a resumed run cannot change: they decide what the checkpoint's weights and optimizer state mean.
FIXED_ON_RESUME = (
    "data", "text_field", "token_dtype", "val_fraction", "tokenizer", "vocab_size", "special_tokens", "init_from",
    "seed", "decay_norms", "lora_rank", "lora_alpha", "lora_targets", "rope_factor",
    "train_on", "chat_template", "chat_layout", "val_data",  # what RUN/data holds
)  # fmt: skip

#: The int settings that may be 0; every other one is at least 1.
MAY_BE_ZERO = ("warmup_steps", "sample_tokens", "seed", "lora_rank")
#: The largest value of an int setting: torch and numpy take int64 (a larger one raised "Overflow when unpacking
#: long long" naming nothing); the seed also seeds numpy's legacy global state, which takes 32 bits.
INT_MAX, SEED_MAX = 2**63 - 1, 2**32 - 1


@dataclass
class TrainConfig:
    """Everything a run needs. Sizes are global: ``batch_size`` sequences per optimizer step over
    all ranks and ``grad_accum`` micro-steps together, so a run gives the same batches (and, up to
    float reassociation, the same weights) on 1 process or N."""

    # Each field's metadata says what it is: ``help``, ``choices`` for a name, and ``shown``, the
    # default as ``tlm train --help`` shows it where the value itself does not say (None, []).
    # Output.
    out_dir: str = field(
        default="runs/default",
        metadata={
            "metavar": "DIR",
            "help": "the run folder: train.toml, tokenizer/, data/, metrics.jsonl, loss.png, checkpoints/",
        },
    )
    # Data.
    data: list[str] = field(
        default_factory=list,
        metadata={
            "metavar": "FILE",
            "help": "text or JSON Lines files (.txt, .jsonl; either may end in .gz or .zst), encoded with the run's "
            "tokenizer, or one token-id file (.npy, or raw .bin/.u16/.u32 with token_dtype)",
            "shown": "Python's own pydoc topics, no download",
        },
    )
    text_field: str = field(
        default="text", metadata={"metavar": "NAME", "help": "the field of each JSON Lines record that holds its text"}
    )
    token_dtype: str = field(
        default="uint16", metadata={"help": "the id type of a raw token file", "choices": TOKEN_DTYPES}
    )
    val_fraction: float = field(
        default=0.1, metadata={"help": "share of the tokens held out for validation (the end of the data)"}
    )
    max_data_bytes: int | None = field(
        default=None,
        metadata={
            "help": "refuse text --data that expands (decompressed, joined) past this many bytes, before the disk "
            "fills",
            "shown": "half the free space of the run folder's disk",
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={"metavar": "DIR", "help": "a tokenizer folder to use instead of training one", "shown": "train one"},
    )
    vocab_size: int = field(
        default=1024,
        metadata={"help": "vocabulary of the tokenizer to train (or the id range of a token file)"},
    )
    special_tokens: list[str] = field(
        default_factory=lambda: ["<|endoftext|>"],
        metadata={"metavar": "TOKEN", "help": "special tokens of the tokenizer to train"},
    )
    # Packed documents, chat data and validation data.
    document_mask: bool = field(
        default=False,
        metadata={
            "help": "attention stops at <|endoftext|> inside a window and positions restart per document: each "
            "packed document trains as if alone (needs a tokenizer with <|endoftext|>)"
        },
    )
    train_on: str = field(
        default="completion",
        metadata={
            "help": "chat data: the target tokens the loss counts: the assistant's (completion), the others "
            "(prompt) or all",
            "choices": TRAIN_ON,
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "metavar": "FILE",
            "help": "chat data: a Jinja chat template file (as transformers reads one) instead of the default",
            "shown": "ChatML, its markers added to the tokenizer as special tokens",
        },
    )
    val_data: list[str] = field(
        default_factory=list,
        metadata={
            "metavar": "FILE",
            "help": "validation files of any --data kind",
            "shown": "the last --val-fraction of --data",
        },
    )
    chat_layout: str = field(
        default="packed",
        metadata={
            "help": "chat data: examples packed into windows (joined by <|endoftext|>) or padded, one per window",
            "choices": CHAT_LAYOUTS,
        },
    )
    # Model: start from `init_from`'s weights and shape, or from `preset` with `model` overriding fields.
    init_from: str | None = field(
        default=None,
        metadata={
            "metavar": "PATH",
            "help": "fine-tune: start from this run, checkpoint or HF Llama folder (its weights, shape and tokenizer)",
            "shown": "random weights",
        },
    )
    rope_factor: float | None = field(
        default=None,
        metadata={
            "metavar": "F",
            "help": "with --init-from and --rope-scaling RULE: the RoPE scaling factor (a longer context: extension)",
            "shown": "the new context_length / the --init-from model's",
        },
    )
    lora_rank: int = field(
        default=0,
        metadata={"help": "LoRA adapters' rank (0: full fine-tuning)", "metavar": "R"},
    )
    lora_alpha: float | None = field(
        default=None, metadata={"help": "LoRA updates are B·A·(alpha/rank)", "shown": "the rank", "metavar": "A"}
    )
    lora_targets: str = field(default="q,v", metadata={"help": "roles: q,k,v,o,w1,w2,w3,lm_head", "metavar": "ROLES"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the adapters' input", "metavar": "P"})
    preset: str = field(
        default="tiny",
        metadata={"help": "the model to start from; the model flags change its fields", "choices": tuple(PRESETS)},
    )
    model: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "ModelConfig fields over the preset's (the [model] table); an ffn other than the preset's "
            "without d_ff takes that kind's course width, tlm_ffn.default_d_ff(d_model, kind=ffn)"
        },
    )
    # Optimizer and schedule (AdamW; linear warm-up then cosine to min_lr).
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate (AdamW)"})
    min_lr: float | None = field(default=None, metadata={"help": "the cosine schedule's floor", "shown": "lr / 10"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW β1"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW β2"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW ε"})
    weight_decay: float = field(default=0.1, metadata={"help": "decoupled weight decay of the matrices"})
    decay_norms: bool = field(default=False, metadata={"help": "also decay 1-D parameters (RMSNorm gains)"})
    warmup_steps: int = field(
        default=20,
        metadata={"help": "linear warm-up steps before the cosine decay (more than the run's: clamped, with a notice)"},
    )
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global gradient L2 norm to this (0: off)"})
    # Steps and batches.
    batch_size: int = field(
        default=16, metadata={"help": "sequences per optimizer step, over all ranks and accumulation steps"}
    )
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    steps: int = field(default=300, metadata={"help": "optimizer steps"})
    max_tokens: int | None = field(
        default=None, metadata={"help": "a token budget instead of steps", "shown": "steps decides"}
    )
    eval_interval: int = field(default=50, metadata={"help": "steps between validation losses"})
    eval_batches: int = field(
        default=8,
        metadata={
            "help": "validation batches per evaluation, when --val-tokens is not given (batch_size ÷ grad_accum "
            "windows each)"
        },
    )
    val_tokens: int | None = field(
        default=None,
        metadata={
            "help": "validation tokens scored at each evaluation, in whole windows of the context spread evenly over "
            "the whole validation data (all of it when it holds fewer); tlm eval --val-tokens scores the same ones",
            "shown": "eval_batches × batch_size ÷ grad_accum windows: 32,768 tokens at the defaults",
        },
    )
    log_interval: int | None = field(
        default=None,
        metadata={
            "help": "steps between logged training losses (each log reads the device once)",
            "shown": f"{LOG_INTERVAL_CPU} on cpu, {LOG_INTERVAL_ACCELERATOR} on an accelerator",
        },
    )
    checkpoint_interval: int = field(default=100, metadata={"help": "steps between checkpoints"})
    keep_checkpoints: int = field(default=2, metadata={"help": "checkpoints kept (the newest always)"})
    async_checkpoint: bool = field(default=True, metadata={"help": "write checkpoints in the background"})
    # Execution.
    device: str = field(default="cpu", metadata={"help": "a torch device: cpu, cuda, cuda:1, mps, ..."})
    dtype: str = field(
        default="float32",
        metadata={
            "help": "autocast dtype of forward/backward (bfloat16 on GPUs; float16 adds loss scaling); weights and "
            "optimizer stay float32",
            "choices": DTYPES,
        },
    )
    compile: bool = field(default=False, metadata={"help": "torch.compile each block"})
    seed: int = field(default=0, metadata={"help": "seeds the weights, the batches and every RNG"})
    deterministic: bool = field(default=True, metadata={"help": "deterministic kernels (bit-exact resume)"})
    distributed: str = field(
        default="none",
        metadata={"help": "under torchrun: ddp, or fsdp (FSDP2, fully_shard per block)", "choices": DISTRIBUTED_MODES},
    )
    activation_checkpointing: bool = field(
        default=False, metadata={"help": "recompute each block's activations in the backward pass"}
    )
    peak_flops: float | None = field(
        default=None,
        metadata={
            "help": "the device's peak FLOP/s for MFU",
            "shown": "the device's published peak for --dtype, else measured",
        },
    )
    tf32: bool = field(default=True, metadata={"help": "float32 matmuls in TF32 on CUDA"})
    tensorboard: bool = field(
        default=False,
        metadata={
            "help": "also write TensorBoard event files to RUN/tensorboard/ (pip install 'tlm-train[tensorboard]'); "
            "metrics.jsonl is always written"
        },
    )
    wandb: bool = field(
        default=False,
        metadata={
            "help": "also log to Weights & Biases (pip install 'tlm-train[wandb]'): project $WANDB_PROJECT (tlm), "
            "files in RUN/wandb/; WANDB_MODE=offline needs no account (wandb sync uploads later)"
        },
    )
    logger_errors: str = field(
        default="stop",
        metadata={
            "help": "when a logger fails (a full disk...): stop (checkpoint, exit status 74) or warn (train on "
            "without it; metrics.jsonl's failure always stops)",
            "choices": LOGGER_ERRORS,
        },
    )
    # The sample printed at the end.
    sample_prompt: str = field(
        default="The ", metadata={"metavar": "TEXT", "help": "the prompt of the sample at the end"}
    )
    sample_tokens: int = field(default=64, metadata={"help": "tokens sampled at the end (0: none)"})
    sample_temperature: float = field(default=0.8, metadata={"help": "temperature of the sample printed at the end"})

    def __post_init__(self) -> None:
        self._check_types()
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
        if self.lora_alpha is not None:
            check_number("TrainConfig.lora_alpha", self.lora_alpha, low=0.0, low_open=True)
        check_number("TrainConfig.lora_dropout", self.lora_dropout, low=0.0, high=1.0, high_open=True)
        try:
            check_targets(self.lora_targets)
        except ValueError as err:
            raise ValueError(f"TrainConfig.lora_targets: {err}") from None
        if self.lora_rank and self.init_from is None:
            raise ValueError("TrainConfig.lora_rank adapts a trained model: give it with TrainConfig.init_from")
        self._check_extension()
        if not self.text_field:
            raise ValueError("TrainConfig.text_field must name a field of the JSON Lines records, got ''")
        if isinstance(self.data, str):
            self.data = [self.data]
        if isinstance(self.val_data, str):
            self.val_data = [self.val_data]
        for name in ("data", "special_tokens", "val_data"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
                raise TypeError(f"TrainConfig.{name} must be a list of non-empty strings, got {value!r}")
        for f in dataclasses.fields(self):
            if "choices" in f.metadata:
                check_choice(f"TrainConfig.{f.name}", getattr(self, f.name), f.metadata["choices"])
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
        _check_device(self.device)  # last: the one check that imports torch

    def _check_types(self) -> None:
        """The int, bool and string fields, by their annotations: an int is at least 1 (an ``int | None`` one when
        given) unless :data:`MAY_BE_ZERO` names it."""
        for f in dataclasses.fields(self):
            name, value = f"TrainConfig.{f.name}", getattr(self, f.name)
            if f.type is int or (f.type == int | None and value is not None):
                check_int(name, value, low=0 if f.name in MAY_BE_ZERO else 1)
                check_int(name, value, high=SEED_MAX if f.name == "seed" else INT_MAX)
            elif f.type is bool:
                check_bool(name, value)
            elif f.type is str and not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
            elif f.type == str | None and value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a path (str) or None, got {value!r}")
            # A command line's bytes that are not UTF-8 arrive as lone surrogates ("\udcff"): train.toml, the
            # tokenizer and the logs cannot hold them, so they are refused here, by name.
            for text in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
                if isinstance(text, str) and not text.isascii():
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as err:
                        raise ValueError(f"{name} must be UTF-8 text, got {short_repr(text)} (a lone surrogate at "
                                         f"character {err.start}: bytes that are not UTF-8)") from None  # fmt: skip

    def _check_extension(self) -> None:
        # A context extension: a RoPE rule by name (or a partial table) is completed against the --init-from
        # model's context (tlm_rope.extension_scaling, in the recipe); without one, only a full table will do.
        scaling = self.model.get("rope_scaling") if isinstance(self.model, dict) else None
        if self.rope_factor is not None:
            check_number("TrainConfig.rope_factor", self.rope_factor, low=1.0)
            if scaling is None or self.init_from is None:
                raise ValueError(
                    "TrainConfig.rope_factor goes with TrainConfig.init_from and a rope_scaling rule (--init-from RUN "
                    "--context-length N --rope-scaling RULE --rope-factor F)"
                )
        if isinstance(scaling, str):
            check_choice("TrainConfig.model.rope_scaling", scaling, RULE_NAMES)
            if self.init_from is None:
                raise ValueError(
                    f"TrainConfig.model.rope_scaling {scaling!r} names a rule, which extends the context of an "
                    "--init-from model; a new model takes the full table (e.g. "
                    '{"rope_type": "linear", "factor": 2.0})'
                )

    @property
    def final_min_lr(self) -> float:
        """The schedule's floor: ``min_lr``, or ``lr / 10`` when it is None."""
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def logging_interval(self, device_type: str) -> int:
        """``log_interval``, or its default for ``device_type`` when it is None."""
        if self.log_interval is not None:
            return self.log_interval
        return LOG_INTERVAL_CPU if device_type == "cpu" else LOG_INTERVAL_ACCELERATOR

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The model's shape: the preset with ``model``'s fields over it, and ``vocab_size`` (the
        tokenizer's) unless ``model`` sets one, which must then agree. A change of ``ffn`` without a
        ``d_ff`` takes the course's width for the new kind (the module docstring)."""
        preset = PRESETS[self.preset]
        fields = {**preset.to_dict(), **self.model}
        if self.init_from is not None and fields["rope_scaling"] is not None:
            try:
                check_scaling(fields["rope_scaling"])
            except (TypeError, ValueError):
                # A rule by name, or part of a table: completed against the --init-from model's context when the
                # run starts (tlm_train.recipe.extended_config); train.toml then records the whole table.
                fields.pop("rope_scaling")
        if vocab_size is not None:
            if "vocab_size" in self.model and self.model["vocab_size"] != vocab_size:
                raise ValueError(
                    f"TrainConfig.model.vocab_size is {self.model['vocab_size']} but the tokenizer/data has "
                    f"{vocab_size} ids; leave [model] vocab_size out to take the tokenizer's"
                )
            fields["vocab_size"] = vocab_size
        try:
            config = ModelConfig.from_dict(fields)  # every field checked, d_model and ffn included
            if config.ffn != preset.ffn and "d_ff" not in self.model:
                config = dataclasses.replace(config, d_ff=default_d_ff(config.d_model, kind=config.ffn))
            return config
        except (TypeError, ValueError) as err:
            raise rephrased(err, f"TrainConfig.model: {err}") from None

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
            data = tomllib.loads(read_input(path, "training config").decode("utf-8"))  # a FIFO: refused
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
            raise rephrased(err, f"{path}: {err}") from None

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
