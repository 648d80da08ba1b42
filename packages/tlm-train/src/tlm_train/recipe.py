"""``train(config)``: the training loop as a recipe (torchtitan and torchtune's shape).

:class:`Recipe` reads top to bottom: :meth:`~Recipe.setup` (run folder and lock, data, model, optimizer,
schedule, sampler, resume), then per step :meth:`~Recipe.train_step`, :meth:`~Recipe.maybe_log`,
:meth:`~Recipe.maybe_evaluate` and :meth:`~Recipe.maybe_checkpoint`, then :meth:`~Recipe.finish` (loss
curve, sample). The same code runs in one process and under ``torchrun`` (``distributed`` = ``"ddp"`` or
``"fsdp"``); rank 0 writes every file. The step's loss is read from the device only on logging steps,
and the next batch is drawn while the device works on the current one.

**Resume** (``resume=True``) continues the newest checkpoint that verifies. Settings that shape the run
(model, data, tokenizer, seed) must equal the saved ones or the resume is refused before anything is
written; the others (learning rate and schedule, steps, intervals, ...) apply from the resumed step on,
and ``train.toml`` is rewritten to say so. Nothing in the run folder changes until the checkpoint has
been read back whole.
"""

import contextlib
import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

import tlm_artifacts
from tlm_artifacts.artifact import load_step_model
from tlm_artifacts.inputs import read_paths
from tlm_artifacts.lora import grown
from tlm_core.atomic import read_input
from tlm_core.checks import rephrased
from tlm_core.progress import progress_bar
from tlm_core.tensors import device_from_name
from tlm_model import PRESETS, ModelConfig, TransformerLM, generate, unwrap
from tlm_optim import AdamW, CosineSchedule
from tlm_rope.options import extension_scaling
from tlm_train.batch import BatchSampler, EvalBatches
from tlm_train.checkpoint import BackgroundSaver, Checkpoint, capture_state, restore_state
from tlm_train.cluster import StopPoll, StopSignals, requeue_job
from tlm_train.config import FIXED_ON_RESUME, TrainConfig
from tlm_train.data import (
    SEPARATOR,
    Dataset,
    DataSettings,
    chat_files,
    check_data_paths,
    is_token_file,
    prepare_data,
)
from tlm_train.determinism import apply, describe, determinism_for, refusal, set_cublas_workspace
from tlm_train.distributed import DistInfo, barrier, build_model, init_distributed, parameter_groups, wrap_model
from tlm_train.evaluate import evaluate, token_byte_lengths
from tlm_train.loggers import LoggerError, Loggers, choose_loggers
from tlm_train.metrics import MetricsLog, peak_flops, plot_loss_curve, training_flops_per_token
from tlm_train.rng import seed_everything
from tlm_train.run_dir import RunDir, check_apart
from tlm_train.step import NonFiniteGuard, NonFiniteLossError, StepStats, train_step

#: The model fields a fine-tune may change: the context is no weight shape (RoPE's tables follow it).
EXTENSION_FIELDS = ("context_length", "rope_scaling")


def extended_config(shape: ModelConfig, config: TrainConfig) -> ModelConfig:
    """The ``--init-from`` model's config ``shape`` at the context ``config`` asks for: its ``context_length``
    and a ``rope_scaling`` rule completed against ``shape``'s context (:func:`tlm_rope.extension_scaling`: the
    factor is the new context over the old unless ``rope_factor`` says). A model whose RoPE is already scaled
    keeps its scaling (one rule cannot be stacked on another), and a model without RoPE has none to scale."""
    target = config.model.get("context_length", shape.context_length)
    rule = config.model.get("rope_scaling", shape.rope_scaling)
    if "rope_scaling" not in config.model or rule == shape.rope_scaling:
        return dataclasses.replace(shape, context_length=target)
    if shape.positions != "rope":
        raise ValueError(f"{flag('rope_scaling')}: the --init-from model has no RoPE to scale (positions='none')")
    if shape.rope_scaling is not None:
        raise ValueError(
            f"{flag('rope_scaling')} {rule!r}: the --init-from model's RoPE is already scaled ({shape.rope_scaling}); "
            "one scaling cannot be stacked on another"
        )
    if rule is None:
        return dataclasses.replace(shape, context_length=target)
    try:
        scaling = extension_scaling(rule, shape.context_length, target, config.rope_factor)
    except (TypeError, ValueError) as err:
        raise rephrased(err, f"{flag('rope_scaling')}: {err}") from None
    return dataclasses.replace(shape, context_length=target, rope_scaling=scaling)


class ResumeError(ValueError):
    """A resume asked for something the run cannot honour; nothing was written."""


@dataclass
class RunResult:
    run_dir: Path
    step: int  # the last completed step
    val_losses: list[tuple[int, float]]  # (step, validation loss), this process's evaluations
    sample: str | None  # decoded text (or ids) generated at the end on rank 0; None when stopped early
    interrupted: bool  # stopped by a signal (SIGINT, SIGTERM, SIGUSR1/2) after writing a checkpoint
    checkpoint: Path | None  # the newest checkpoint written
    requeued: bool = False  # stopped by SIGUSR1/SIGUSR2 in a SLURM job, which rank 0 put back in the queue
    #: A stop signal came while training, also one too late to stop it (during the last step's checkpoint): a run
    #: that finished anyway says so, for whoever runs it (a sweep) to stop there.
    stop_requested: bool = False


def flag(name: str) -> str:
    """The command-line flag of a setting: ``min_lr`` -> ``--min-lr``."""
    return "--" + name.replace("_", "-")


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    resume_from: int | None = None,
    log: Callable[[str], None] | None = None,
    progress: bool | None = None,
) -> RunResult:
    """Run ``config`` to its last step (or until SIGINT, SIGTERM, SIGUSR1 or SIGUSR2, which checkpoint at the
    next step boundary and return; after SIGUSR1/SIGUSR2 in a SLURM job, rank 0 also requeues the job).

    ``resume`` continues ``config.out_dir`` from its newest checkpoint that verifies (``resume_from``: from
    that step, abandoning later ones); without it, a folder that already holds checkpoints is refused.
    ``log`` receives one line per evaluation and event (rank 0 only); ``progress`` shows a tqdm bar
    (``None``: only on a terminal). Raises :class:`~tlm_train.NonFiniteLossError` when the loss or the
    gradient norm is not finite, naming the newest checkpoint whose weights gave a finite loss. A logging
    backend that fails (a full disk, a read-only or vanished folder) stops the run at that step with a
    checkpoint (when the disk takes it) and raises :class:`~tlm_train.loggers.LoggerError` saying so; with
    ``config.logger_errors == "warn"`` the run goes on without that backend instead (``metrics.jsonl``, which
    every command reads, always stops it).
    """
    # The device is checked before a process group is joined on it.
    settings = determinism_for(device_from_name(config.device, "--device").type, config.deterministic)
    cuda_notes = set_cublas_workspace(settings)  # before this process's first cuBLAS call
    info = init_distributed(config.device)
    owns_group = info.world_size > 1
    recipe: Recipe | None = None
    try:
        recipe = Recipe(config, info, resume=resume, resume_from=resume_from, log=log, progress=progress)
        recipe.cuda_notes = cuda_notes
        with recipe:
            return recipe.run()
    finally:
        if owns_group and dist.is_initialized():
            # The DDP/FSDP2 wrappers go first, while the group is still registered, so that the group is shut
            # down by destroy_process_group and not by the last wrapper's destructor: that one runs holding the
            # GIL and joins gloo's worker threads, which may need the GIL to free a finished work's tensors (a
            # hang at exit seen once in 2-rank DDP runs).
            recipe = None
            gc.collect()
            dist.destroy_process_group()


def data_settings(config: TrainConfig) -> DataSettings:
    """The settings of ``config`` that the run's data depends on (:mod:`tlm_train.data` reads no other)."""
    return DataSettings(**{f.name: getattr(config, f.name) for f in dataclasses.fields(DataSettings)})


class Recipe:
    """One training run; use as a context manager (it holds the run folder's lock) and call :meth:`run`."""

    def __init__(
        self,
        config: TrainConfig,
        info: DistInfo,
        *,
        resume: bool = False,
        resume_from: int | None = None,
        log: Callable[[str], None] | None = None,
        progress: bool | None = None,
    ) -> None:
        self.config, self.info = config, info
        self.resume, self.resume_from = resume or resume_from is not None, resume_from
        self.say = (log or (lambda line: None)) if info.is_main else (lambda line: None)
        self.progress = progress
        self.run_dir = RunDir(config.out_dir)
        self._exit = contextlib.ExitStack()
        self.val_losses: list[tuple[int, float]] = []
        self.last_checkpoint: Path | None = None
        self._prune_pending = False
        self.loggers = Loggers()  # the chosen backends, opened once the run goes ahead (rank 0 only)
        self.logger_error: LoggerError | None = None  # a backend's failure that stops the run
        self._clock = (time.perf_counter(), 0.0)  # (when training began here, seconds of earlier processes)
        self.cuda_notes: list[str] = []  # what train() set in the environment for a deterministic CUDA run
        self.saver = BackgroundSaver()  # checkpoints, written while training goes on
        self.requeue = False  # a SIGUSR1/SIGUSR2 stop (on any rank): the SLURM job goes back in the queue
        # However the run ends, the save in flight is finished (the newest checkpoint is complete, or absent).
        self._exit.callback(self._settle_saves)

    def __enter__(self) -> "Recipe":
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit.close()

    # ------------------------------------------------------------------------------------- setup

    def setup(self) -> None:
        config, info = self.config, self.info
        _check_runtime(config, info, resume=self.resume)
        if info.is_main:
            self.run_dir.check_links()
            self.run_dir.check_layout()
            self._lock = self._exit.enter_context(self.run_dir.lock())
        saved = self._check_resume() if self.resume else None
        if not self.resume:
            self._check_fresh()
        # Bit-exact on this device or refused here; restored when the run ends.
        self.determinism = determinism_for(info.device.type, config.deterministic)
        self._exit.callback(apply(self.determinism))
        if info.device.type == "cuda":
            self._cuda_settings()
        seed_everything(config.seed)
        source, source_tokenizer = self._init_source()
        self.data = self._prepare_data(saved, source, source_tokenizer)
        # A resumed run builds the model its train.toml records (checked against the request above).
        self.model_config = saved.model_config() if saved is not None else self._model_config(self.data, source)
        if self.data.vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"the data's token ids reach {self.data.vocab_size - 1}, beyond the model's vocab_size "
                f"{self.model_config.vocab_size}"
            )
        self._build_training(source)
        self._build_batches()
        self.metrics = MetricsLog(self.run_dir.metrics_path)
        self.start = self._restore() if self.resume else 0
        if self.start > self.steps:
            raise ResumeError(f"{flag('steps')} {self.steps} is below the step the run has reached ({self.start})")
        self._commit(saved)

    def _prepare_data(self, saved: TrainConfig | None, source: TransformerLM | None, tokenizer: Any) -> Dataset:
        """The run's data, prepared by rank 0 first (it writes the run's token files), then read by the others."""
        config, info = self.config, self.info
        if config.document_mask and tokenizer is None and config.data and is_token_file(config.data[0]):
            self._document_mask_id(Dataset(np.empty(0), np.empty(0), 0))  # refused before the data is read
        shape = source.config if source is not None else (saved or config).model_config()
        options = dict(
            tokenizer=tokenizer, context_length=shape.context_length,  # chat rows take context + 1 tokens
            vocab_size=source.config.vocab_size if source is not None else None,
        )  # fmt: skip
        if info.is_main:
            data = prepare_data(data_settings(config), self.run_dir, is_main=True, resume=self.resume, **options)
        barrier()
        if not info.is_main:
            data = prepare_data(data_settings(config), self.run_dir, is_main=False, **options)
        return data

    def _build_training(self, source: TransformerLM | None) -> None:
        """The model (from ``source`` when fine-tuning; LoRA-adapted when asked), its training wrapper, the
        optimizer, the schedule and the mixed-precision settings."""
        config, info = self.config, self.info
        self.model = build_model(self.model_config, info.device, seed=config.seed)
        if source is not None and (not self.resume or config.lora_rank):  # a LoRA run's base is never saved
            self.model.load_state_dict(grown(source.state_dict(), self.model_config.vocab_size))
        self.lora: dict[str, Any] | None = None
        if config.lora_rank:
            self.lora = self._adapt(cast(TransformerLM, source))
        self.loss_module = wrap_model(
            self.model,
            config.distributed,
            activation_checkpointing=config.activation_checkpointing,
            document_mask_id=self._document_mask_id(self.data),
            compile=config.compile,  # before sharding, as torchtitan does
            param_dtype=torch.bfloat16 if config.dtype == "bfloat16" else None,
        )
        self.optimizer = AdamW(
            parameter_groups(self.model, config.weight_decay, decay_norms=config.decay_norms),
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
        self.steps = config.total_steps()
        if config.warmup_steps > self.steps:
            # Clamped, not refused: the default warm-up (20) would otherwise refuse every short run.
            self.say(
                f"{flag('warmup_steps')} {config.warmup_steps} is longer than the run's {self.steps} steps: the "
                f"learning rate warms up over all {self.steps} and never decays"
            )
        self.scheduler = CosineSchedule(
            self.optimizer,
            max_learning_rate=config.lr,
            min_learning_rate=config.final_min_lr,
            warmup_iters=min(config.warmup_steps, self.steps),
            cosine_cycle_iters=self.steps,
        )
        self.scaler = torch.amp.GradScaler(info.device.type) if config.dtype == "float16" else None
        self.autocast = None if config.dtype == "float32" else getattr(torch, config.dtype)

    def _build_batches(self) -> None:
        """The training sampler and the fixed validation windows."""
        config, info, data = self.config, self.info, self.data
        # Each rank draws its disjoint share of every global micro-batch from the same seeded stream,
        # so the batches (and the weights, up to float reassociation) do not depend on world_size.
        micro = config.batch_size // config.grad_accum
        context = self.model_config.context_length
        self.sampler = BatchSampler(
            data.train, micro // info.world_size, context, info.device, seed=config.seed, rank=info.rank,
            world_size=info.world_size, rows=data.rows,
        )  # fmt: skip
        # Every rank evaluates the same fixed windows (cheap, and no reduction needed), spread evenly over the
        # whole validation data: --val-tokens of them in whole windows, else eval_batches micro-batches.
        val_windows = micro * config.eval_batches if config.val_tokens is None else -(-config.val_tokens // context)
        self.val_batches = EvalBatches(
            data.val, micro, context, info.device, windows=val_windows, stride=context + 1 if data.rows else None,
        )  # fmt: skip
        self.val_scored = len(self.val_batches.starts) * context  # target positions (a chat prompt's score none)
        self.val_total = len(data.val)
        # Each token's byte length, so that every evaluation also gives bits per byte (val_bpb): a measure that
        # compares across tokenizers (tlm compare uses it).
        self.val_token_bytes = (
            None if data.tokenizer is None
            else token_byte_lengths(data.tokenizer, self.model_config.vocab_size).to(info.device)
        )  # fmt: skip

    def _document_mask_id(self, data: Dataset) -> int | None:
        """The end-of-text id that ``document_mask`` splits windows at (None without it)."""
        if not self.config.document_mask:
            return None
        tokenizer = data.tokenizer
        if tokenizer is None or SEPARATOR not in tokenizer.special_tokens:
            raise ValueError(
                f"{flag('document_mask')} splits windows at {SEPARATOR}, which "
                + ("token-id data without --tokenizer does not name" if tokenizer is None else "the tokenizer lacks")
            )
        return int(tokenizer.encode(SEPARATOR)[0])

    def _cuda_settings(self) -> None:
        """TF32 for float32 matmuls (unless --no-tf32) and, for a deterministic run, what CUDA needs for it;
        each said in one line at start, and restored when the run ends."""
        config = self.config
        precision = torch.get_float32_matmul_precision()
        self._exit.callback(torch.set_float32_matmul_precision, precision)
        torch.set_float32_matmul_precision("high" if config.tf32 else "highest")
        if config.dtype == "float32":
            self.say(
                "float32 matmuls on TF32 tensor cores" if config.tf32 else "float32 matmuls in full float32 (--no-tf32)"
            )
        if config.deterministic:  # the flags were set in setup (tlm_train.determinism)
            self.say(describe(self.determinism) + "".join(f"; {note}" for note in self.cuda_notes))

    def _check_fresh(self) -> None:
        if self.run_dir.checkpoints().all_steps():
            raise ValueError(
                f"--out-dir {self.run_dir.path} already holds a run: continue it with --resume {self.run_dir.path}, or "
                "choose another --out-dir"
            )

    def _check_resume(self) -> TrainConfig:
        """The saved settings; refuses a change to the model or to any of FIXED_ON_RESUME (before anything
        is written) and records the others, which apply from the resumed step on."""
        saved = self.run_dir.read_config(out_dir=self.config.out_dir)
        for name in FIXED_ON_RESUME:
            if getattr(saved, name) != getattr(self.config, name):
                self._refuse(name, getattr(saved, name), getattr(self.config, name))
        # The model: the saved [model] table is the resolved one; the request is a preset with fields over it
        # (for a fine-tune, the saved shape with fields over it). Compared field by field.
        have = saved.model_config()
        base = have.to_dict() if self.config.init_from is not None else PRESETS[self.config.preset].to_dict()
        want = {**base, "vocab_size": have.vocab_size, **self.config.model}
        if self.config.init_from is not None and set(EXTENSION_FIELDS) & set(self.config.model):
            # A context extension is what it resolves to against the --init-from model (a rule by name included).
            shape = tlm_artifacts.model_config(tlm_artifacts.resolve(self.config.init_from))
            extended = extended_config(shape, self.config)
            want.update({name: getattr(extended, name) for name in EXTENSION_FIELDS})
        for name, value in want.items():
            if value != getattr(have, name):
                self._refuse("preset" if saved.preset != self.config.preset else name, getattr(have, name), value)
        self.applied = {
            f.name: (getattr(saved, f.name), getattr(self.config, f.name))
            for f in dataclasses.fields(TrainConfig)
            if f.name not in ("model", "preset") and getattr(saved, f.name) != getattr(self.config, f.name)
        }
        return saved

    def _refuse(self, name: str, have: Any, want: Any) -> None:
        if name == "preset":
            have, want = "the run's model", self.config.preset
        raise ResumeError(
            f"--resume {self.run_dir.path}: {flag(name)} {want!r} differs from the run's {have!r}; a run keeps its "
            "model, data, tokenizer and seed (start a new run with --init-from to fine-tune it)"
        )

    def _init_source(self) -> tuple[TransformerLM | None, Any]:
        """The model and tokenizer ``init_from`` names (None, None without it). The tokenizer comes from
        there when tlm can read the one it has, else from ``--tokenizer``."""
        config = self.config
        tokenizer = None
        if config.tokenizer is not None:
            from tlm_tokenizer import Tokenizer

            tokenizer = Tokenizer.load(config.tokenizer)
        if config.init_from is None:
            return None, tokenizer
        artifact = tlm_artifacts.resolve(config.init_from)
        if self.resume and not config.lora_rank:  # the weights come from the run's checkpoint; only the tokenizer
            model = None
        else:
            model, _ = tlm_artifacts.load_model(artifact, dtype=torch.float32, on_damaged=self._damaged)
        try:
            own = tlm_artifacts.load_tokenizer(artifact)
        except tlm_artifacts.UnreadableTokenizer as err:
            own = None
            if tokenizer is None and not (config.data and is_token_file(config.data[0])):
                raise ValueError(
                    f"--init-from {config.init_from}: its tokenizer is not one tlm can reproduce ({err}); give "
                    "--tokenizer DIR, or token-id data"
                ) from None
        if own is not None and tokenizer is not None:
            self.say(f"--tokenizer {config.tokenizer} is used; the tokenizer of --init-from is not")
        return model, tokenizer if tokenizer is not None else own

    def _adapt(self, base: TransformerLM) -> dict[str, Any]:
        """Freeze the model and give it the adapters the config asks for; the record a checkpoint keeps of
        them and of the base (the path ``init_from`` names and its weights' SHA-256)."""
        from tlm_artifacts.lora import adapt
        from tlm_lora import weights_sha256

        config = self.config
        # Before any adapter is allocated: a rank of 10**6 on a d_model of 32 trained for minutes on matrices 30,000x
        # wider than any update can use. No projection it adapts has a rank above d_model (what PEFT import refuses).
        if config.lora_rank > base.config.d_model:
            raise ValueError(
                f"{flag('lora_rank')} {config.lora_rank} is more than the --init-from model's d_model "
                f"{base.config.d_model}: no projection it adapts has a rank that high"
            )
        if base.config.tie_word_embeddings and "lm_head" in config.lora_targets.split(","):
            raise ValueError(
                f"{flag('lora_targets')} names lm_head, but the --init-from model ties it to its embedding (merging "
                "would change the embedding too); leave lm_head out"
            )
        alpha = float(config.lora_rank if config.lora_alpha is None else config.lora_alpha)
        lora = {
            "rank": config.lora_rank,
            "alpha": alpha,
            "targets": config.lora_targets,
            "dropout": config.lora_dropout,
        }
        # The base as --init-from holds it (float32), before a chat template's markers grew its vocabulary:
        # what a reader loads again and grows the same way (tlm_artifacts.artifact.load_lora_step).
        sha256 = weights_sha256(base.state_dict())
        adapt(self.model, lora, seed=config.seed)
        # The frozen base in the training dtype: what autocast multiplies with anyway. Not under FSDP2, whose
        # MixedPrecisionPolicy gathers every parameter in that dtype already (and wants one dtype per group).
        if config.dtype != "float32" and config.distributed != "fsdp":
            from tlm_lora import cast_frozen_weights

            cast_frozen_weights(self.model, getattr(torch, config.dtype))
        return {**lora, "base": {"path": str(Path(cast(str, config.init_from)).resolve()), "sha256": sha256}}

    def _model_config(self, data: Dataset, source: TransformerLM | None) -> ModelConfig:
        config = self.config
        if config.init_from is None:
            return config.model_config(data.vocab_size)
        # A fine-tune keeps the model's shape, vocabulary included (an HF model's may exceed its tokenizer's).
        shape = cast(TransformerLM, source).config
        for name, value in config.model.items():
            if name not in EXTENSION_FIELDS and getattr(shape, name) != value:
                raise ValueError(
                    f"{flag(name)} {value!r} differs from the --init-from model's {getattr(shape, name)!r}; a "
                    "fine-tune keeps the model's shape (only the context may grow: --context-length, --rope-scaling)"
                )
        extended = extended_config(shape, config)
        if extended.context_length != shape.context_length or extended.rope_scaling != shape.rope_scaling:
            self.say(
                f"the context grows from {shape.context_length} to {extended.context_length} tokens"
                + (f" (RoPE scaling {extended.rope_scaling})" if extended.rope_scaling != shape.rope_scaling else "")
            )
        # Only the vocabulary may grow: special tokens that chat data adds (the template's markers).
        vocab = max(shape.vocab_size, data.vocab_size)
        if vocab > shape.vocab_size:
            chat = chat_files(config.data, config.text_field)
            why = "for the chat template's markers" if chat else "for the data's tokenizer"
            self.say(f"the vocabulary grows from {shape.vocab_size} to {vocab} ids {why}")
        return dataclasses.replace(extended, rope_layout="interleaved", vocab_size=vocab)

    def _restore(self) -> int:
        manager = self.run_dir.checkpoints(self.config.keep_checkpoints)
        if self.resume_from is not None:
            checkpoint = manager.load(self.resume_from)
        else:
            if not manager.all_steps():
                self.say(f"no checkpoint in {manager.directory} yet: starting from step 0")
                return 0
            latest = manager.load_latest(on_damaged=self._damaged)
            if latest is None:
                raise ResumeError(
                    f"--resume {self.run_dir.path}: every checkpoint in {manager.directory} is damaged; none can be "
                    "read back, so nothing was resumed"
                )
            checkpoint = latest
        return self._load(checkpoint)

    def _load(self, checkpoint: Checkpoint) -> int:
        state = checkpoint.state
        if self.lora is not None and state.get("lora", {}).get("base", {}).get("sha256") != self.lora["base"]["sha256"]:
            raise ResumeError(
                f"--resume {self.run_dir.path}: --init-from {self.config.init_from} is not the base model its "
                f"adapters were trained on (the weights' SHA-256 differs from the one {checkpoint.path} records)"
            )
        step = restore_state(state, self.model, self.optimizer, scheduler=self.scheduler, sampler=self.sampler)
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        saved_ranks = state.get("world_size", 1)
        note = (
            f" (saved with {saved_ranks} ranks, now {self.info.world_size})"
            if saved_ranks != self.info.world_size
            else ""
        )
        self.say(f"resumed from step {step}{note}")
        return step

    def _damaged(self, step: int, error: Exception) -> None:
        self.say(f"checkpoint of step {step} is damaged ({str(error).splitlines()[0][:160]}): taking the one before")

    def _commit(self, saved: TrainConfig | None) -> None:
        """The first writes of a run, made once everything above has been checked and read."""
        if not self.info.is_main:
            return
        manager = self.run_dir.checkpoints(self.config.keep_checkpoints)
        manager.remove_leftovers()
        if self.resume:
            if removed := manager.remove_after(self.start):
                self.say(f"removed the checkpoints after step {self.start} (steps {removed}): this run replaces them")
            changes = {k: v for k, v in getattr(self, "applied", {}).items() if k != "out_dir"}
            if changes:
                self.say("settings changed from the resumed step on: " + ", ".join(
                    f"{flag(k)} {new!r} (was {old!r})" for k, (old, new) in changes.items()))  # fmt: skip
        self.metrics.truncate(self.start if self.start else -1)  # the file reads as if the run never stopped
        # Wall-clock time continues from the last record kept: a resumed run's curve does not count the pause.
        earlier = [r["time_s"] for r in self.metrics.read() if isinstance(r.get("time_s"), (int, float))]
        self._clock = (time.perf_counter(), earlier[-1] if earlier else 0.0)
        names = [name for name in ("tensorboard", "wandb") if getattr(self.config, name)]
        model = self.model_config.to_dict(drop_none=True)
        resolved = self.config.replace(vocab_size=model["vocab_size"], model=model)  # what train.toml records
        self.loggers = choose_loggers(names, self.run_dir.path, start_step=self.start, config=resolved.to_dict())
        self._exit.callback(self.loggers.close)
        if self.resume and getattr(self, "applied", None):
            self._log({"step": self.start, "event": "resume", "changed": {k: v[1] for k, v in self.applied.items()}})
        # train.toml records what runs: the model resolved field by field (the vocabulary the tokenizer gave,
        # the shape --init-from gave), so a resume or `--config train.toml` builds the same model; its one
        # vocabulary size is the model's (a --tokenizer's or --init-from's may differ from the flag's default).
        self.run_dir.write_config(resolved)
        self._lock.record()

    # ---------------------------------------------------------------------------------- the loop

    def run(self) -> RunResult:
        self.setup()
        config, info = self.config, self.info
        tokens_per_step = config.batch_size * self.model_config.context_length
        self.flops_per_token = training_flops_per_token(self.model_config, self.model_config.context_length)
        if config.peak_flops is not None:
            self.peak, source = config.peak_flops, "--peak-flops"
        else:
            tf32 = config.tf32 and info.device.type == "cuda"
            self.peak, source = peak_flops(info.device, config.dtype, tf32=tf32)
        self.say(f"MFU against {self.peak / 1e12:,.3g} TFLOP/s per device ({source})")
        self.tokens_per_step = tokens_per_step
        self._clock = (time.perf_counter(), self._clock[1])  # set-up (data, model, GEMM rate) is not training time
        if self.start == 0:
            self.maybe_evaluate(0, force=True)
        step, interrupted = self.start, False
        show = self.progress if info.is_main else False  # None: only on a terminal
        bar = progress_bar(show, total=self.steps, initial=self.start, unit="step")
        self._mark = (time.perf_counter(), self.start)
        # The first non-finite step, remembered on the device; read where the loop syncs anyway.
        self.guard = NonFiniteGuard(info.device, start_step=self.start)
        with StopSignals() as signals:
            stops = self._exit.enter_context(_closing_poll(StopPoll(info.world_size)))
            batches = self._draw()
            for step in range(self.start + 1, self.steps + 1):
                stats = self.train_step(step, batches)
                sampler_state = self.sampler.state_dict()  # before the next draw: what a resume at `step` needs
                if step < self.steps:
                    batches = self._draw()  # drawn while the device still works on this step
                logged = self.maybe_log(step, stats, bar)
                self.maybe_evaluate(step)
                # Ranks must agree on the step they stop at, and on the step that finishes the save in flight
                # (its error raised on every rank there): compared where the step syncs anyway.
                asked = signals.requested or self.logger_error is not None
                if info.world_size == 1:
                    stop, writing = asked, not self.saver.idle()
                else:
                    stop, writing = self._any_rank(asked, not self.saver.idle()) if logged else (False, True)
                signalled, requeue = stops.poll(signals.requested, signals.requeue)  # every step, every rank
                stop = stop or signalled
                if self._prune_pending and logged and not writing:
                    self._prune()  # the steps after the save gave a finite loss: older checkpoints can go
                if stop and self.logger_error is not None:
                    self._stop_for_logger(step, sampler_state)
                    break
                self.maybe_checkpoint(step, sampler_state, force=stop)
                if stop:
                    interrupted, self.requeue = True, requeue or signals.requeue
                    self.say(
                        f"stopped at step {step}: checkpoint {self.last_checkpoint}; continue with --resume "
                        f"{self.run_dir.path}"
                    )
                    break
        bar.close()
        result = self.finish(step, interrupted or self.logger_error is not None)
        result.stop_requested = signals.requested
        if self.requeue and info.is_main:  # SIGUSR1/SIGUSR2: time is running out; the checkpoint is written
            result.requeued = requeue_job(self.say)
        if self.logger_error is not None:
            raise self.logger_error
        return result

    def _stop_for_logger(self, step: int, sampler_state: dict[str, Any]) -> None:
        """A backend failed: checkpoint this step if the disk takes it, and say so in the error the run raises."""
        error = cast(LoggerError, self.logger_error)
        try:
            self.maybe_checkpoint(step, sampler_state, force=True)
            saved = f"checkpoint {self.last_checkpoint}"
        except OSError as err:  # the disk that failed the logger may refuse the checkpoint too
            saved = f"no checkpoint of step {step} ({err.strerror or err}); the newest is {self.last_checkpoint}"
        error.args = (f"{error.args[0]}; stopped at step {step}: {saved}; continue with --resume {self.run_dir.path}",)

    def _draw(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [next(self.sampler) for _ in range(self.config.grad_accum)]

    def train_step(self, step: int, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepStats:
        # Never raises for a non-finite loss: the update is skipped on the device and the guard remembers
        # the step; _halt_if_diverged reads it where the loop syncs anyway.
        try:
            return train_step(
                self.loss_module,
                self.optimizer,
                batches,
                scheduler=self.scheduler,
                max_grad_norm=self.config.grad_clip,
                autocast_dtype=self.autocast,
                scaler=self.scaler,
                guard=self.guard,
                before_update=self.saver.wait_staged,  # a sharded save's async staging: done before the update
            )
        except RuntimeError as err:  # an op without a deterministic kernel on this device: refused in one line
            refused = refusal(err) if self.config.deterministic else None
            if refused is None:
                raise
            raise refused from err

    def _halt_if_diverged(self, *values: torch.Tensor) -> list[float]:
        """Stop the run (``event: diverged``) if a step since the last look was not finite; the weights and
        optimizer state are then those from before that step. Reads the device once, with ``values`` (0-d
        tensors) in the same transfer, returned as floats: called only where the loop syncs anyway (logging,
        evaluation, a checkpoint)."""
        try:
            return self.guard.check(self.optimizer, self.scheduler, also=values)
        except NonFiniteLossError as err:
            failed = cast(int, self.guard.first())
            raise self._diverged(f"step {failed}: {err}; {self._good_checkpoint(failed)}", failed) from None

    def _diverged(self, message: str, step: int) -> NonFiniteLossError:
        """The error that stops a run whose loss or weights stopped being finite, recorded in the log first
        (``event: diverged``), so that the run folder says how it ended."""
        self._log({"step": step, "event": "diverged", "message": message})
        return NonFiniteLossError(message)

    def _log(self, record: dict[str, Any]) -> None:
        """Give ``record`` to every logging backend (rank 0), with the seconds since training began. A backend
        that fails is dropped; it stops the run at this step unless ``logger_errors`` is "warn"."""
        if self.info.is_main:
            began, before = self._clock
            try:
                self.loggers.log({**record, "time_s": before + time.perf_counter() - began})
            except LoggerError as err:
                if self.config.logger_errors == "warn" and err.name != "jsonl":
                    self.say(f"{err}; training goes on without it (--logger-errors warn)")
                elif self.logger_error is None:
                    self.logger_error = err

    def _good_checkpoint(self, failed: int) -> str:
        self._settle_saves()  # the save in flight may be the one to name
        # Step `failed` computed its loss on the weights of step failed - 1, so a checkpoint of that step holds
        # weights that give a non-finite loss; one of an earlier step was followed by a finite step.
        good = [s for s in self.run_dir.checkpoints().steps() if s <= failed - 2]
        if not good:
            return "no checkpoint holds weights that gave a finite loss"
        path = self.run_dir.checkpoints().path(good[-1])
        return f"the newest checkpoint whose weights gave a finite loss is step {good[-1]}: tlm train --resume {path}"

    def maybe_log(self, step: int, stats: StepStats, bar: Any) -> bool:
        """Read the step's numbers from the device and record them, on logging steps only."""
        config = self.config
        every = config.logging_interval(self.info.device.type)
        if not (step % every == 0 or step % config.eval_interval == 0 or step == self.steps):
            bar.update()
            return False
        loss, grad_norm = self._halt_if_diverged(stats.loss, stats.grad_norm)  # the step's one device read
        began, since = self._mark
        seconds = max(time.perf_counter() - began, 1e-9)
        rate = self.tokens_per_step * (step - since) / seconds
        self._mark = (time.perf_counter(), step)
        self._record = {
            "step": step,
            "tokens": step * self.tokens_per_step,
            "train_loss": loss,
            "lr": stats.lr,
            "grad_norm": grad_norm,
            "tokens_per_s": rate,
            "mfu": self.flops_per_token * rate / (self.peak * self.info.world_size),
        }
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{stats.lr:.2e}", tok_s=f"{rate:,.0f}", refresh=False)
        bar.update()
        if step % config.eval_interval and step != self.steps:
            self._log(self._record)
        return True

    def maybe_evaluate(self, step: int, *, force: bool = False) -> None:
        if not (force or step % self.config.eval_interval == 0 or step == self.steps):
            return
        if step > 0:
            self._halt_if_diverged()
        result = evaluate(self.loss_module, self.val_batches, autocast_dtype=self.autocast,
                          token_bytes=self.val_token_bytes)  # fmt: skip
        loss = result.loss
        scores = {"val_loss": loss, **({"val_bpb": result.bits_per_byte} if result.bits_per_byte is not None else {})}
        self.val_losses.append((step, loss))
        if step == 0:
            self.say(
                f"step 0: validation loss {loss:.4f} (ln(vocab) = {math.log(self.model_config.vocab_size):.4f}) on "
                f"{self.val_scored:,} tokens in windows spread over the {self.val_total:,} of the validation data "
                f"({flag('val_tokens')})"
            )
            self._log({"step": 0, "tokens": 0, **scores})
            return
        record = {**self._record, **scores}
        self.say(
            f"step {step}: validation loss {loss:.4f} ({self.val_scored:,} tokens), train loss "
            f"{record['train_loss']:.4f}"
        )
        self._log(record)

    def maybe_checkpoint(self, step: int, sampler_state: dict[str, Any], *, force: bool = False) -> None:
        if not (force or step % self.config.checkpoint_interval == 0 or step == self.steps):
            return
        self._halt_if_diverged()  # never a checkpoint of skipped steps
        state = capture_state(self.model, self.optimizer, step=step, scheduler=self.scheduler)
        state["sampler"] = sampler_state
        if self.lora is not None:  # the adapters only: the frozen base is the --init-from model, named here
            from tlm_artifacts.lora import is_adapter_key

            state["model"] = {k: v for k, v in state["model"].items() if is_adapter_key(k)}
            state["lora"] = self.lora
            state["model_config"] = self.model_config.to_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self._any_rank(not _finite(state["model"]))[0]:
            raise self._diverged(
                f"step {step}: the weights hold NaN or infinite values; {self._good_checkpoint(step + 1)}", step
            )
        manager = self.run_dir.checkpoints(self.config.keep_checkpoints)
        self.saver.wait()  # the previous save is written (and its leftovers are no longer ours to keep)
        if self.info.is_main:
            manager.remove_leftovers()  # of a save that a kill interrupted (this process holds the run's lock)
        if self.info.is_main or state["sharded"]:  # sharded: every rank writes its part
            if self.config.async_checkpoint and not force:
                self.last_checkpoint = self.saver.submit(manager, unwrap(self.model), state)
            else:  # a stop writes its checkpoint before saying where it is
                self.last_checkpoint = manager.save(unwrap(self.model), state)
            self._prune_pending = True
        barrier()

    def _settle_saves(self) -> None:
        try:
            self.saver.close()  # the run is ending: its staging buffers can go
        except Exception as err:  # the run is already ending with its own error; say this one too
            self.say(f"the checkpoint being written when the run stopped failed: {err}")

    def _prune(self) -> None:
        self.saver.wait()  # never prune past a folder still being written
        if self.info.is_main:
            self.run_dir.checkpoints(self.config.keep_checkpoints).prune()
        self._prune_pending = False

    def _any_rank(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag, true when it is true on any rank (one all-reduce for all of them)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return flags
        device = self.info.device if self.info.device.type == "cuda" else "cpu"
        value = torch.tensor([int(f) for f in flags], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in value.tolist())

    # ---------------------------------------------------------------------------------- the end

    def finish(self, step: int, interrupted: bool) -> RunResult:
        sample = None
        self.saver.wait()
        if self._prune_pending:
            self._prune()  # the run ended; its last checkpoint is the newest and stays
        if self.info.is_main:
            try:
                if plot_loss_curve(self.run_dir.metrics_path, self.run_dir.plot_path) is None:
                    self.say("matplotlib is not installed: no loss.png (pip install matplotlib)")
            except OSError as err:  # a full disk: the checkpoint and metrics.jsonl are what matter
                self.say(f"no loss.png: {err.strerror or err}")
            if not interrupted and self.config.sample_tokens > 0 and self.last_checkpoint is not None:
                sample = self._sample()
        barrier()
        return RunResult(self.run_dir.path, step, self.val_losses, sample, interrupted, self.last_checkpoint)

    def _sample(self) -> str:
        # A plain copy of the final weights from the checkpoint: works whatever the training wrapper.
        model = load_step_model(cast(Path, self.last_checkpoint)).eval()
        tokenizer, config = self.data.tokenizer, self.config
        if tokenizer is not None:
            prompt = tokenizer.encode(config.sample_prompt) or [0]
            eos = [tokenizer.encode(SEPARATOR)[0]] if SEPARATOR in tokenizer.special_tokens else None
        else:
            prompt, eos = [int(self.data.val[0])], None
        out = generate(
            model,
            torch.tensor(prompt),
            config.sample_tokens,
            temperature=config.sample_temperature,
            top_k=50,
            eos_token_id=eos,
            generator=torch.Generator().manual_seed(config.seed),
        ).tolist()
        return tokenizer.decode(out) if tokenizer is not None else " ".join(map(str, out))


def _finite(weights: dict[str, torch.Tensor]) -> bool:
    """Whether this rank's part of the weights (its FSDP2 shards, or the whole model) is finite."""
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in weights.values()]
    return all(bool(torch.isfinite(t).all()) for t in local if t.is_floating_point())


def _check_runtime(config: TrainConfig, info: DistInfo, *, resume: bool) -> None:
    """What the machine must offer, checked before anything is written."""
    if info.world_size > 1 and config.distributed == "none":
        raise ValueError("launched by torchrun with several ranks: choose --distributed ddp or fsdp")
    if config.distributed != "none" and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"--distributed {config.distributed} needs several processes: launch with torchrun")
    micro = config.batch_size // config.grad_accum
    if micro % info.world_size:
        raise ValueError(
            f"--batch-size {config.batch_size} with --grad-accum {config.grad_accum} gives micro-batches of {micro}, "
            f"which do not divide among {info.world_size} ranks"
        )
    if (config.data or config.val_data) and not resume:  # a resumed run reads the tokens it saved, not the text
        check_data_paths(config.data, config.val_data)
    if config.chat_template is not None and not resume:
        _check_chat_template(config.chat_template)
    if config.tokenizer is not None and not Path(config.tokenizer).is_dir():
        raise FileNotFoundError(f"--tokenizer {config.tokenizer}: no such folder")
    if config.init_from is not None and not Path(config.init_from).exists():
        raise FileNotFoundError(f"--init-from {config.init_from}: no such file or folder")
    check_apart(config.out_dir, input_paths(config))


def input_paths(config: TrainConfig) -> dict[str, list[str]]:
    """What a run reads, by flag: its run folder (or a sweep's folder of runs) must not overlap any of them."""
    inputs: dict[str, Sequence[str | None]] = {
        # A LoRA run or PEFT adapter reads its base model too: that is an input as well.
        "--init-from": [] if config.init_from is None else [str(p) for p in read_paths(config.init_from)],
        "--tokenizer": [config.tokenizer],
        "--data": config.data,
        "--val-data": config.val_data,
        "--chat-template": [config.chat_template],
    }
    return {name: [p for p in paths if p is not None] for name, paths in inputs.items()}


def _check_chat_template(path: str) -> None:
    """A ``--chat-template`` file that exists, reads and compiles, before anything is written."""
    from tlm_tokenizer.chat import compile_template

    source = read_input(path, "--chat-template")  # missing, a FIFO, a device or a folder: one line naming it
    try:
        compile_template(source.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"--chat-template {path}: {err}") from None


@contextlib.contextmanager
def _closing_poll(poll: StopPoll) -> Iterator[StopPoll]:
    """The stop agreement for the loop; its last all-reduce is waited for however the loop ends."""
    try:
        yield poll
    finally:
        poll.close()
