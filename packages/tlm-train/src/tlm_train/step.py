"""One optimizer step: the loss as a module (:class:`LanguageModelLoss`) and :func:`train_step`.

Works unchanged on a plain module, under DDP and under FSDP2: the loss is the wrapped module's
``forward`` (the call DDP and FSDP hook), and the loss is averaged over the ranks with an all-reduce
(no host synchronisation). The step returns its loss and gradient norm as tensors on the device, so a
loop reads them (``.item()``, a device round trip) only when it logs. A non-finite loss or gradient
norm stops the step before the update, through a device-side assert (``torch._assert_async``): the
step never reads a value back to the host.
"""

import contextlib
import math
from collections.abc import Iterable, Iterator
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
) -> StepStats:
    """One optimizer step over ``micro_batches`` (gradient accumulation): forward, backward, the loss
    averaged over ranks, clipping, the optimizer and scheduler steps.

    ``scaler`` (a ``torch.amp.GradScaler``, for float16 autocast) scales the loss before backward and
    unscales the gradients before clipping. Raises :class:`NonFiniteLossError` (on every rank alike)
    before touching the weights when the loss or the gradient norm is NaN or infinite; on an
    accelerator the check is a device-side assert, so the step never waits for the device.
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
    try:
        # A device-side assert, so the step never waits for the device: on the CPU it raises here,
        # before the update; on an accelerator the device raises it, and the update does not run.
        torch._assert_async(finite, "training loss or gradient norm is not finite: stopped before the update")
    except RuntimeError:
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(
            f"training loss is {float(mean)}, gradient norm {float(norm)}: stopped before the update"
        ) from None
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return StepStats(loss=mean, grad_norm=norm, lr=lr)
