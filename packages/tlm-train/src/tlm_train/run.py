"""``train(config)``: a whole run, from text to a trained model, a loss curve and a sample.

The same function runs in one process and under ``torchrun`` (``config.distributed`` = ``"ddp"``
or ``"fsdp"``); rank 0 writes every file. A run directory holds ``train.toml``, the data it
derived (``tokenizer/``, ``train.npy``, ``val.npy``), ``metrics.jsonl``, ``loss.png`` and
``checkpoints/step_*.pt``; :func:`train` with ``resume=True`` continues from the newest
checkpoint that reads back, and ends with the weights and metrics of a run never stopped.
"""

import math
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from tlm_model import TransformerLM, generate
from tlm_optim import AdamW, CosineSchedule
from tlm_train.atomic import atomic_write_text
from tlm_train.batch import BatchSampler, EvalBatches
from tlm_train.config import CONFIG_NAME, TrainConfig
from tlm_train.corpus import Dataset, prepare_data
from tlm_train.distributed import DistInfo, barrier, build_model, init_distributed, wrap_model
from tlm_train.metrics import (
    METRICS_NAME,
    PLOT_NAME,
    MetricsLog,
    measure_gemm_flops,
    plot_loss_curve,
    training_flops_per_token,
)
from tlm_train.trainer import (
    CheckpointManager,
    NonFiniteLossError,
    capture_state,
    evaluate_loss,
    restore_state,
    train_step,
)

CHECKPOINT_DIR = "checkpoints"


@dataclass
class RunResult:
    run_dir: Path
    step: int  # the last completed step
    val_losses: list[tuple[int, float]]  # (step, validation loss), this process's evaluations
    sample: str | None  # decoded text (or ids) generated at the end on rank 0; None when stopped early
    interrupted: bool  # stopped by SIGINT/SIGTERM after writing a checkpoint
    checkpoint: Path | None  # the newest checkpoint written


def total_steps(config: TrainConfig) -> int:
    """``config.steps``, or the steps that a token budget (``max_tokens``) takes."""
    if config.max_tokens is None:
        return config.steps
    return math.ceil(config.max_tokens / (config.batch_size * _context_length(config)))


def _context_length(config: TrainConfig) -> int:
    return config.model_config(vocab_size=1).context_length


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    log: Callable[[str], None] | None = None,
    progress: bool | None = None,
) -> RunResult:
    """Run ``config`` to its last step (or until SIGINT/SIGTERM, which checkpoint and return).

    ``resume`` continues from the newest readable checkpoint in ``config.out_dir`` (a fresh start
    when there is none); without it, a directory that already holds checkpoints is refused.
    ``log`` receives one line per evaluation and event (rank 0 only); ``progress`` shows a tqdm bar
    (``None``: only on a terminal). Raises :class:`~tlm_train.trainer.NonFiniteLossError` when the
    loss or the gradient norm is not finite; the last checkpoint written stays.
    """
    info = init_distributed(config.device)
    owns_group = info.world_size > 1
    try:
        return _run(config, info, resume=resume, log=log if info.is_main else None, progress=progress)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _run(
    config: TrainConfig, info: DistInfo, *, resume: bool, log: Callable[[str], None] | None, progress: bool | None
) -> RunResult:
    say = log or (lambda line: None)
    if config.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=info.device.type != "cpu")
    if info.world_size > 1 and config.distributed == "none":
        raise ValueError("launched by torchrun with several ranks: choose distributed = 'ddp' or 'fsdp'")
    run_dir = Path(config.out_dir)
    manager = CheckpointManager(run_dir / CHECKPOINT_DIR, keep=config.keep_checkpoints)
    if info.is_main:
        if manager.steps() and not resume:
            raise ValueError(
                f"out_dir {str(run_dir)!r} already holds checkpoints: pass --resume {run_dir} to continue "
                f"it, or choose another --out-dir"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / CONFIG_NAME, config.to_toml())
        data = prepare_data(config, run_dir, is_main=True)
    barrier()
    if not info.is_main:
        data = prepare_data(config, run_dir, is_main=False)

    model_config = config.model_config(data.vocab_size)
    model = build_model(model_config, info.device, seed=config.seed)
    loss_module = wrap_model(model, config.distributed, activation_checkpointing=config.activation_checkpointing)
    if config.compile:
        for block in model.layers:
            block.compile()
    optimizer = AdamW(
        model.parameters(),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
    )
    steps = total_steps(config)
    if config.warmup_steps > steps:
        raise ValueError(f"warmup_steps ({config.warmup_steps}) must not exceed the run's {steps} steps")
    scheduler = CosineSchedule(
        optimizer,
        max_learning_rate=config.lr,
        min_learning_rate=cast(float, config.min_lr),  # __post_init__ filled None
        warmup_iters=config.warmup_steps,
        cosine_cycle_iters=steps,
    )
    # Each rank draws its disjoint share of every global micro-batch from the same seeded stream,
    # so the batches (and the weights, up to float reassociation) do not depend on world_size.
    micro = config.batch_size // config.grad_accum
    if config.batch_size % config.grad_accum or micro % info.world_size:
        raise ValueError(
            f"batch_size ({config.batch_size}) must split into grad_accum ({config.grad_accum}) micro-batches "
            f"that divide among {info.world_size} ranks"
        )
    sampler = BatchSampler(
        data.train,
        micro // info.world_size,
        model_config.context_length,
        info.device,
        seed=config.seed,
        rank=info.rank,
        world_size=info.world_size,
    )
    # Every rank evaluates the same fixed windows (cheap, and no reduction needed).
    val_batches = EvalBatches(
        data.val, micro, model_config.context_length, info.device, max_batches=config.eval_batches
    )
    metrics = MetricsLog(run_dir / METRICS_NAME)
    autocast = None if config.dtype == "float32" else getattr(torch, config.dtype)

    start = 0
    if resume:
        state = manager.load_latest()
        if state is None:
            say(f"no readable checkpoint in {run_dir / CHECKPOINT_DIR}: starting from step 0")
        else:
            start = restore_state(state, model, optimizer, scheduler=scheduler, sampler=sampler)
            saved_ranks = state.get("world_size", 1)
            note = f" (saved with {saved_ranks} ranks, now {info.world_size})" if saved_ranks != info.world_size else ""
            say(f"resumed from step {start}{note}")
            del state
    if info.is_main:
        if start == 0:
            metrics.truncate(-1)  # a fresh run starts a fresh file
        else:
            metrics.truncate(start)

    def val_loss() -> float:
        return evaluate_loss(loss_module, val_batches, autocast_dtype=autocast)

    tokens_per_step = config.batch_size * model_config.context_length
    flops_per_token = training_flops_per_token(model_config, model_config.context_length)
    peak = config.peak_flops or measure_gemm_flops(info.device)
    val_losses: list[tuple[int, float]] = []
    if start == 0:
        loss0 = val_loss()
        val_losses.append((0, loss0))
        if info.is_main:
            metrics.append({"step": 0, "tokens": 0, "val_loss": loss0})
        say(f"step 0: validation loss {loss0:.4f} (ln(vocab) = {math.log(model_config.vocab_size):.4f})")

    last_checkpoint, interrupted, step = None, False, start
    quiet = not info.is_main or progress is False or (progress is None and not sys.stderr.isatty())
    bar = tqdm(total=steps, initial=start, disable=quiet, unit="step", dynamic_ncols=True)
    with _stop_requests() as requested:
        for step in range(start + 1, steps + 1):
            batches = [next(sampler) for _ in range(config.grad_accum)]
            began = time.perf_counter()
            try:
                stats = train_step(
                    loss_module,
                    optimizer,
                    batches,
                    scheduler=scheduler,
                    max_grad_norm=config.grad_clip,
                    autocast_dtype=autocast,
                )
            except NonFiniteLossError as err:
                kept = manager.steps()
                where = f"the last good checkpoint is step {kept[-1]} in {manager.directory}" if kept else ""
                where = where or "no checkpoint was written yet"
                raise NonFiniteLossError(f"step {step}: {err}; {where}") from None
            seconds = time.perf_counter() - began
            rate = tokens_per_step / seconds
            record: dict[str, Any] = {
                "step": step,
                "tokens": step * tokens_per_step,
                "train_loss": stats.loss,
                "lr": stats.lr,
                "grad_norm": stats.grad_norm,
                "tokens_per_s": rate,
                "mfu": flops_per_token * rate / (peak * info.world_size),
            }
            if step % config.eval_interval == 0 or step == steps:
                record["val_loss"] = val_loss()
                val_losses.append((step, record["val_loss"]))
                say(f"step {step}: validation loss {record['val_loss']:.4f}, train loss {stats.loss:.4f}")
            if info.is_main and (step % config.log_interval == 0 or "val_loss" in record or step == steps):
                metrics.append(record)
            bar.set_postfix(loss=f"{stats.loss:.3f}", lr=f"{stats.lr:.2e}", tok_s=f"{rate:,.0f}", refresh=False)
            bar.update()
            stop = _any_rank(requested())
            if stop or step % config.checkpoint_interval == 0 or step == steps:
                last_checkpoint = _checkpoint(manager, info, model, optimizer, scheduler, sampler, step, config)
            if stop:
                interrupted = True
                say(f"stopped at step {step}: checkpoint {last_checkpoint}; continue with --resume {run_dir}")
                break
    bar.close()
    sample = None
    if info.is_main:
        if plot_loss_curve(run_dir / METRICS_NAME, run_dir / PLOT_NAME) is None:
            say("matplotlib is not installed: no loss.png (pip install matplotlib)")
        if not interrupted and config.sample_tokens > 0:
            sample = _sample(model_config, manager, step, data, config, info)
    barrier()
    return RunResult(run_dir, step, val_losses, sample, interrupted, last_checkpoint)


def _checkpoint(
    manager: CheckpointManager,
    info: DistInfo,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sampler: BatchSampler,
    step: int,
    config: TrainConfig,
) -> Path | None:
    state = capture_state(model, optimizer, step=step, scheduler=scheduler, sampler=sampler)
    path = None
    if info.is_main:
        state["model_config"] = cast(Any, model).config.to_dict()
        path = manager.save(state)
    barrier()
    return path


def _any_rank(flag: bool) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


@contextmanager
def _stop_requests() -> Iterator[Callable[[], bool]]:
    """SIGINT (Ctrl-C) and SIGTERM (torchrun stopping its workers) ask the loop to checkpoint
    and return at the end of the current step; a second SIGINT interrupts at once."""
    requested = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal requested
        if requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        requested = True

    try:
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: signals stay as they are
        previous = {}
    try:
        yield lambda: requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _sample(
    model_config: Any, manager: CheckpointManager, step: int, data: Dataset, config: TrainConfig, info: DistInfo
) -> str:
    # A plain copy of the final weights from the checkpoint: works whatever the training wrapper.
    model = TransformerLM(model_config)
    model.load_state_dict(manager.load(step)["model"])
    model.eval()
    tokenizer = data.tokenizer
    if tokenizer is not None:
        prompt = tokenizer.encode(config.sample_prompt) or [0]
    else:
        prompt = [int(data.val[0])]
    room = model_config.context_length - len(prompt)
    generator = torch.Generator().manual_seed(config.seed)
    out = generate(
        model,
        torch.tensor(prompt[-model_config.context_length + 1 :]),
        max(1, min(config.sample_tokens, room)),
        temperature=config.sample_temperature,
        top_k=50,
        generator=generator,
    ).tolist()
    return tokenizer.decode(out) if tokenizer is not None else " ".join(map(str, out))
