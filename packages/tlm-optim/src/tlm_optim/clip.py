"""Gradient clipping by the global L2 norm (CS336 assignment 1, §4.5)."""

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from tlm_core.checks import check_number


def _tensors(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    if isinstance(parameters, Tensor):
        return [parameters]
    if not isinstance(parameters, Iterable):
        raise TypeError(f"parameters must be a Tensor or an iterable of Tensors, got {type(parameters).__name__}")
    out = list(parameters)
    for i, p in enumerate(out):
        if not isinstance(p, Tensor):
            raise TypeError(f"parameters[{i}] must be a Tensor, got {type(p).__name__}")
    return out


def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_l2_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale every gradient in place by ``max_l2_norm / (norm + eps)`` if their joint L2 norm exceeds it.

    ``norm`` is one L2 norm over all gradients together; parameters whose ``.grad`` is None are
    skipped. Returns that norm (before clipping) as a float32 scalar tensor, without a
    device-to-host synchronisation. Sparse gradients are refused.
    """
    params = _tensors(parameters)
    # Infinity is allowed, as torch's clip_grad_norm_ allows it: the norm without clipping.
    if not (isinstance(max_l2_norm, float) and max_l2_norm == math.inf):
        max_l2_norm = check_number("max_l2_norm", max_l2_norm, low=0.0)
    eps = check_number("eps", eps, low=0.0)
    grads = [p.grad for p in params if p.grad is not None]
    if any(g.is_sparse for g in grads):
        raise TypeError("clip_grad_norm_ supports dense gradients only, got a sparse gradient")
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    device = grads[0].device
    # Per group, one multi-tensor norm; squares are summed in float32 (float64 stays float64). One stack
    # per group and no per-tensor conversion: the usual case (one float32 group) is four kernels.
    partial = []
    for (_, dtype), group in groups.items():
        norms = torch.stack(torch._foreach_norm(group, 2))
        partial.append(norms.to(device, torch.promote_types(dtype, torch.float32)))
    stacked = (
        partial[0]
        if len(partial) == 1
        else torch.cat([p.to(torch.promote_types(p.dtype, torch.float32)) for p in partial])
    )
    total = torch.linalg.vector_norm(stacked)
    # Scale only when the norm exceeds the maximum (multiplying by exactly 1 leaves the rest untouched).
    scale = torch.where(total > max_l2_norm, max_l2_norm / (total + eps), torch.ones_like(total))
    for (grad_device, _), group in groups.items():
        torch._foreach_mul_(group, scale if grad_device == device else scale.to(grad_device))
    return total.to(torch.float32) if total.dtype != torch.float64 else total
