"""One optimizer step: the loss as a module (:class:`LanguageModelLoss`) and :func:`train_step`.

Works unchanged on a plain module, under DDP and under FSDP2: the loss is the wrapped module's
``forward`` (the call DDP and FSDP hook), and the loss is averaged over the ranks with an all-reduce
(no host synchronisation). The step returns its loss and gradient norm as tensors on the device, so a
loop reads them (``.item()``, a device round trip) only when it logs.

A non-finite loss or gradient norm skips the update on the device (the optimizer's ``found_inf``, as
torch's fused AdamW and ``GradScaler`` use it), with no read back to the host: a
:class:`NonFiniteGuard` remembers the first such step on the device, keeps every later step's update
skipped too, and is read where the loop synchronises anyway (logging, evaluation, a checkpoint). Its
:meth:`~NonFiniteGuard.check` then winds the optimizer's step counters and the schedule back and raises
:class:`NonFiniteLossError`: the weights and optimizer state are those from before that step. No
device-side assert: on CUDA a failed ``torch._assert_async`` is no Python exception but a poisoned
context, after which nothing (not even a last save) can run.
"""

import contextlib
import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from jaxtyping import Int
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from tlm_model import document_ids
from tlm_optim import clip_grad_norm_


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; the weights were not updated."""


class LanguageModelLoss(nn.Module):
    """``forward(inputs, targets)`` is ``model.loss(inputs, targets)``: the mean next-token
    cross-entropy without materialising the logits. DDP and FSDP2 act on a module's forward, so
    wrap this module, not the model, and keep using ``model`` for state dicts and generation.

    ``document_mask_id`` (the end-of-text id) masks attention at the document boundaries inside each
    window: the document ids come from the inputs on the device (``cumsum``), read by nothing on the host.
    """

    def __init__(self, model: nn.Module, *, document_mask_id: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.document_mask_id = document_mask_id

    def forward(self, inputs: Int[Tensor, "batch seq"], targets: Int[Tensor, "batch seq"]) -> Tensor:
        if self.document_mask_id is None:
            return cast(Any, self.model).loss(inputs, targets)
        documents = document_ids(inputs, self.document_mask_id)
        return cast(Any, self.model).loss(inputs, targets, document_ids=documents)


@dataclass(frozen=True)
class StepStats:
    """What a step measured, as 0-d tensors on the training device (read them when logging)."""

    loss: Tensor  # mean over the global batch (all ranks, all micro-batches)
    grad_norm: Tensor  # before clipping
    lr: float  # the learning rate this step used


class NonFiniteGuard:
    """The first step whose loss or gradient norm was not finite, remembered on the device.

    :func:`train_step` records each step here and skips the update (on the device) from the first
    non-finite step on. :meth:`check`, called where the loop reads the device anyway, raises
    :class:`NonFiniteLossError` naming that step, after winding the optimizer's step counters and the
    learning-rate schedule back over the skipped steps, so that the weights, the optimizer state and the
    schedule are bit-for-bit those from before it. Every rank holds the same flag (the loss and the
    gradient norm are global), so every rank stops at the same step.
    """

    def __init__(self, device: torch.device | str, start_step: int = 0) -> None:
        self.step = start_step  # the last step recorded (host count; no device read)
        self._first = torch.zeros((), dtype=torch.int64, device=device)  # 0: every step was finite
        self._loss = torch.zeros((), dtype=torch.float32, device=device)
        self._norm = torch.zeros((), dtype=torch.float32, device=device)

    def record(self, finite: Tensor, loss: Tensor, norm: Tensor) -> Tensor:
        """Note one step (``finite``: a 0-d bool tensor); the ``found_inf`` flag (0-d float32, 1.0: skip the
        update) for this step: set from the first non-finite step on."""
        self.step += 1
        new = (self._first == 0) & ~finite
        self._first.copy_(torch.where(new, self.step, self._first))
        self._loss.copy_(torch.where(new, loss.detach().float(), self._loss))
        self._norm.copy_(torch.where(new, norm.detach().float(), self._norm))
        return (self._first != 0).float()

    def first(self) -> int | None:
        """The first non-finite step, or None (reads the device: call it where the loop syncs anyway)."""
        return int(self._first) or None  # the one device read

    def check(
        self, optimizer: torch.optim.Optimizer, scheduler: Any = None, *, also: Sequence[Tensor] = ()
    ) -> list[float]:
        """Raise :class:`NonFiniteLossError` if a step was not finite (:meth:`first` names it), with the
        optimizer's step counters and ``scheduler`` wound back to the step before it (the weights and
        moments were never updated). ``also`` (0-d tensors on the guard's device, a logging step's loss and
        gradient norm) are read in the same transfer as the flag and returned as floats."""
        flag = (self._first != 0).to(torch.float32)
        flag, *values = torch.stack([flag, *(t.detach().to(torch.float32).reshape(()) for t in also)]).tolist()
        if not flag:  # the one device read of a step that went well
            return values
        first = cast(int, self.first())
        skipped = self.step - first + 1
        rewind(optimizer, scheduler, skipped)
        self.step = first - 1
        raise self.error()

    def error(self) -> NonFiniteLossError:
        """The error naming the first non-finite step's loss and gradient norm (reads the device)."""
        return NonFiniteLossError(
            f"training loss is {float(self._loss)}, gradient norm {float(self._norm)}: stopped before the update"
        )


def rewind(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> None:
    """Undo the host-side bookkeeping of ``steps`` optimizer steps whose update was skipped on the device:
    the per-parameter step counters (a state whose counter returns to 0 is dropped, as before its first
    step) and the scheduler's epoch and learning rates."""
    if steps <= 0:
        return
    for param, state in list(optimizer.state.items()):
        if "step" not in state:
            continue
        count = state["step"] - steps
        if (count == 0).all() if isinstance(count, Tensor) else count == 0:
            del optimizer.state[param]
        else:
            state["step"] = count
    if scheduler is not None:
        # Closed-form schedules only (tlm_optim.CosineSchedule's lr is a function of the epoch alone).
        scheduler.last_epoch -= steps
        if hasattr(scheduler, "_step_count"):
            scheduler._step_count -= steps
        with torch.optim.lr_scheduler._enable_get_lr_call(scheduler):
            lrs = scheduler.get_lr()
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _global_mean(value: Tensor) -> Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
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
        return _fsdp_no_sync(module)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module) -> Iterator[None]:
    cast(Any, module).set_requires_gradient_sync(False)
    try:
        yield
    finally:
        cast(Any, module).set_requires_gradient_sync(True)


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for a reduced-precision ``dtype``; nothing for float32 or None."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """The L2 norm of all gradients together, and, when ``max_norm > 0`` and the norm exceeds it,
    every gradient scaled by ``max_norm / (norm + 1e-6)`` (the course's rule). Sharded (DTensor)
    gradients are handled by torch's own ``clip_grad_norm_``; plain ones by ``tlm_optim``'s."""
    params = [p for p in parameters if p.grad is not None]
    if any(isinstance(p.grad, DTensor) for p in params):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    if max_norm > 0:
        return clip_grad_norm_(params, max_norm)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))


def train_step(
    loss_module: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[Tensor, Tensor]],
    *,
    scheduler: Any = None,
    max_grad_norm: float = 0.0,
    autocast_dtype: torch.dtype | None = None,
    scaler: "torch.amp.GradScaler | None" = None,
    guard: NonFiniteGuard | None = None,
    before_update: Callable[[], None] | None = None,
) -> StepStats:
    """One optimizer step over ``micro_batches`` (gradient accumulation): forward, backward, the loss
    averaged over ranks, clipping, the optimizer and scheduler steps.

    ``scaler`` (a ``torch.amp.GradScaler``, for float16 autocast) scales the loss before backward and
    unscales the gradients before clipping. A NaN or infinite loss or gradient norm skips the update on
    the device. With ``guard`` the step never reads the device: the guard remembers the step and
    skips every later update too, and its :meth:`~NonFiniteGuard.check` raises where the loop syncs.
    Without one, the step checks at its end (one device read) and raises :class:`NonFiniteLossError`
    (on every rank alike) with the weights and optimizer state untouched. The optimizer's ``step``
    must take ``found_inf`` (``tlm_optim.AdamW`` does); another optimizer's update is skipped
    through one device read. ``before_update`` is called just before the optimizer changes the weights (a
    checkpoint still copying them, asynchronously, waits there: the forward and backward ran meanwhile).
    """
    if not micro_batches:
        raise ValueError("micro_batches must hold at least one (inputs, targets) pair, got none")
    lr = float(optimizer.param_groups[0]["lr"])
    optimizer.zero_grad(set_to_none=True)
    total: Tensor | None = None
    for i, (inputs, targets) in enumerate(micro_batches):
        with _no_sync(loss_module, i == len(micro_batches) - 1):
            with autocast(inputs.device, autocast_dtype):
                loss = loss_module(inputs, targets) / len(micro_batches)
            (loss if scaler is None else scaler.scale(loss)).backward()
        total = loss.detach().float() if total is None else total + loss.detach().float()
    mean = _global_mean(cast(Tensor, total))
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = grad_norm_(loss_module.parameters(), max_grad_norm)
    # With a scaler, a non-finite gradient is the scaler's business (it skips the step and lowers the scale).
    finite = torch.isfinite(mean) if scaler is not None else torch.isfinite(mean) & torch.isfinite(norm)
    own = guard is None
    if guard is None:
        guard = NonFiniteGuard(mean.device)
    found_inf = guard.record(finite, mean, norm)
    found_inf_kw: dict[str, Tensor] = {"found_inf": found_inf}
    if not _takes_found_inf(optimizer):
        # An optimizer that cannot skip on the device: one device read, and no update at all.
        if bool(found_inf):
            optimizer.zero_grad(set_to_none=True)
            raise guard.error()
        found_inf_kw = {}
    if before_update is not None:
        before_update()
    if scaler is not None:
        scaler.step(optimizer, **found_inf_kw)
        scaler.update()
    else:
        cast(Any, optimizer).step(**found_inf_kw)
    if scheduler is not None:
        scheduler.step()
    if own:
        try:
            guard.check(optimizer, scheduler)
        except NonFiniteLossError:
            optimizer.zero_grad(set_to_none=True)
            raise
    return StepStats(loss=mean, grad_norm=norm, lr=lr)


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    try:
        return "found_inf" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):  # pragma: no cover - a step without a signature
        return False
