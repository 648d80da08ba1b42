"""The training loop's parts, each usable from a script of your own: the loss as a module
(:class:`LanguageModelLoss`), one optimizer step (:func:`train_step`), evaluation
(:func:`evaluate_loss`) and checkpoints (:class:`CheckpointManager`, :func:`capture_state`,
:func:`restore_state`); batches come from :class:`tlm_train.BatchSampler` and
:class:`tlm_train.EvalBatches`. :func:`tlm_train.train` strings them together.

Every part works unchanged on a plain module, under DDP and under FSDP2: the loss is the wrapped
module's ``forward`` (the call DDP and FSDP hook), losses and stop requests are averaged over the
ranks, and checkpoints hold full (gathered) state dicts, so a run resumes on any number of ranks.
"""

import contextlib
import math
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from jaxtyping import Int
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tlm_optim import clip_grad_norm_
from tlm_train.atomic import atomic_write
from tlm_train.rng import rng_state, set_rng_state


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; the weights were not updated."""


class LanguageModelLoss(nn.Module):
    """``forward(inputs, targets)`` is ``model.loss(inputs, targets)``: the mean next-token
    cross-entropy without materialising the logits. DDP and FSDP2 act on a module's forward, so
    wrap this module, not the model, and keep using ``model`` for state dicts and generation."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: Int[Tensor, "batch seq"], targets: Int[Tensor, "batch seq"]) -> Tensor:
        return cast(Any, self.model).loss(inputs, targets)


@dataclass(frozen=True)
class StepStats:
    loss: float  # mean over the global batch (all ranks, all micro-batches)
    grad_norm: float  # before clipping
    lr: float  # the learning rate this step used


def _global_mean(value: Tensor) -> Tensor:
    if dist.is_available() and dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value


def _no_sync(module: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    # Skip the gradient all-reduce on all but the last micro-batch of an accumulation.
    if sync:
        return contextlib.nullcontext()
    if hasattr(module, "no_sync"):  # DDP
        return cast(Any, module).no_sync()
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        cast(Any, module).set_requires_gradient_sync(False)

        @contextlib.contextmanager
        def restore() -> Iterator[None]:
            try:
                yield
            finally:
                cast(Any, module).set_requires_gradient_sync(True)

        return restore()
    return contextlib.nullcontext()


def grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """The L2 norm of all gradients together, and, when ``max_norm > 0`` and the norm exceeds it,
    every gradient scaled by ``max_norm / (norm + 1e-6)`` (the course's rule). Sharded (DTensor)
    gradients are handled by torch's own ``clip_grad_norm_``; plain ones by ``tlm_optim``'s."""
    params = [p for p in parameters if p.grad is not None]
    if any(type(p.grad).__name__ == "DTensor" for p in params):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if max_norm > 0:
        return torch.as_tensor(clip_grad_norm_(params, max_norm))
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))


def train_step(
    loss_module: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[Tensor, Tensor]],
    *,
    scheduler: Any = None,
    max_grad_norm: float = 0.0,
    autocast_dtype: torch.dtype | None = None,
) -> StepStats:
    """One optimizer step over ``micro_batches`` (gradient accumulation): forward, backward,
    the loss averaged over ranks, clipping, the optimizer and scheduler steps.

    Raises :class:`NonFiniteLossError` (on every rank alike) before touching the weights when the
    loss or the gradient norm is NaN or infinite.
    """
    if not micro_batches:
        raise ValueError("micro_batches must hold at least one (inputs, targets) pair, got none")
    lr = float(optimizer.param_groups[0]["lr"])
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for i, (inputs, targets) in enumerate(micro_batches):
        with _no_sync(loss_module, i == len(micro_batches) - 1):
            with _autocast(inputs.device, autocast_dtype):
                loss = loss_module(inputs, targets) / len(micro_batches)
            loss.backward()
        total += loss.detach().double().cpu()
    mean = float(_global_mean(total))
    norm = grad_norm_(loss_module.parameters(), max_grad_norm)
    norm_value = float(norm)
    if not (math.isfinite(mean) and math.isfinite(norm_value)):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(f"training loss is {mean}, gradient norm {norm_value}: stopping before the update")
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return StepStats(loss=mean, grad_norm=norm_value, lr=lr)


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@torch.no_grad()
def evaluate_loss(
    loss_module: nn.Module, batches: Iterable[tuple[Tensor, Tensor]], *, autocast_dtype: torch.dtype | None = None
) -> float:
    """Token-weighted mean loss of ``loss_module(inputs, targets)`` over ``batches``, in eval mode
    (the training mode is restored). Under DDP/FSDP every rank passes the same batches (e.g.
    :class:`tlm_train.EvalBatches`), so every rank gets the same number."""
    was_training = loss_module.training
    loss_module.eval()
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    try:
        for inputs, targets in batches:
            with _autocast(inputs.device, autocast_dtype):
                total += loss_module(inputs, targets).double().cpu() * targets.numel()
            tokens += targets.numel()
    finally:
        loss_module.train(was_training)
    if tokens == 0:
        raise ValueError("batches must hold at least one (inputs, targets) pair, got none")
    return float(total / tokens)


_OPTIONS = StateDictOptions(full_state_dict=True, cpu_offload=True)


def capture_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    scheduler: Any = None,
    sampler: Any = None,
    **extra: Any,
) -> dict[str, Any]:
    """Everything a bit-exact resume needs, as plain tensors and containers (``torch.load``
    with ``weights_only=True`` reads it): full model and optimizer state dicts (gathered from all
    ranks when sharded; every rank must call this, and rank 0 gets the data), the scheduler and
    sampler states and the RNG states (:func:`tlm_train.rng_state`)."""
    if _is_plain(model):
        model_state, optim_state = model.state_dict(), _named_optimizer_state(model, optimizer)
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    return {
        "step": step,
        "model": model_state,
        "optimizer": optim_state,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "sampler": None if sampler is None else sampler.state_dict(),
        "rng": rng_state(),
        "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
        **extra,
    }


def restore_state(
    state: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Any = None,
    sampler: Any = None,
) -> int:
    """Load what :func:`capture_state` saved into the (possibly wrapped or sharded) model and
    optimizer, on any number of ranks; every rank passes the full ``state``. Returns the step."""
    if _is_plain(model):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(_indexed_optimizer_state(model, optimizer, state["optimizer"]))
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if sampler is not None and state.get("sampler") is not None:
        sampler.load_state_dict(state["sampler"])
    if state.get("rng") is not None:
        set_rng_state(state["rng"])
    return int(state["step"])


def _is_plain(model: nn.Module) -> bool:
    # One process and unsharded parameters: the module's own state dicts are already complete
    # (and this path also handles layouts that torch.distributed.checkpoint cannot name, such
    # as TransformerLM's fused projections).
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return not distributed and not any(type(p).__name__ == "DTensor" for p in model.parameters())


def _parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    names = {id(p): name for name, p in model.named_parameters()}
    try:
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    except KeyError:
        raise ValueError("optimizer holds a parameter that is not in model; pass the model it optimizes") from None


def _named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name, the layout torch.distributed.checkpoint's
    full state dicts use, so that a checkpoint from one process loads under DDP/FSDP2 and back."""
    names = _parameter_names(model, optimizer)
    saved = optimizer.state_dict()
    return {
        "state": {names[i]: value for i, value in saved["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]],
    }


def _indexed_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict:
    index = {name: i for i, name in enumerate(_parameter_names(model, optimizer))}
    unknown = sorted(set(state["state"]) - set(index))
    if unknown:
        raise ValueError(f"checkpoint holds optimizer state for parameters the model lacks: {unknown[:5]}")
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


class CheckpointManager:
    """Numbered checkpoints in a folder: ``step_00000100.pt``, ... .

    :meth:`save` writes all-or-nothing (a failed write leaves every earlier checkpoint intact) and
    then deletes all but the ``keep`` newest; :meth:`load_latest` returns the newest checkpoint that
    reads back completely, passing over any that do not.
    """

    PATTERN = re.compile(r"step_(\d+)\.pt")

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.directory, self.keep = Path(directory), keep

    def path(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}.pt"

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        found = (self.PATTERN.fullmatch(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def save(self, state: dict[str, Any]) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = atomic_write(self.path(int(state["step"])), lambda file: torch.save(state, file))
        for old in self.steps()[: -self.keep]:
            self.path(old).unlink(missing_ok=True)
        return path

    def load(self, step: int) -> dict[str, Any]:
        path = self.path(step)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # a truncated or foreign file: torch raises several types
            raise ValueError(f"{path} is not a readable tlm-train checkpoint: {err}") from err

    def load_latest(self) -> dict[str, Any] | None:
        for step in reversed(self.steps()):
            try:
                return self.load(step)
            except ValueError:
                continue
        return None
