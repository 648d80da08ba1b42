"""AdamW as CS336 assignment 1 (§4.3, Algorithm 2) writes it, after Loshchilov & Hutter (2019).

For each parameter θ with gradient g, at step t = 1, 2, ...:

    m ← β₁ m + (1 − β₁) g
    v ← β₂ v + (1 − β₂) g²
    α_t = α · √(1 − β₂ᵗ) / (1 − β₁ᵗ)
    θ ← θ − α_t · m / (√v + ε)
    θ ← θ − α λ θ                      (decoupled weight decay, applied AFTER the Adam update)

torch.optim.AdamW differs in two small ways: it decays θ *before* the Adam update (the two orders
differ by α·λ·α_t·m/(√v+ε) per step), and it adds ε to √v / √(1 − β₂ᵗ) rather than to √v.

The default multi-tensor path folds the decay into the update: θ·(1 − αλ) − α_t (1 − αλ)·u equals
(θ − α_t u)(1 − αλ), the course's order, with one pass over θ fewer than torch's foreach AdamW.
"""

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from tlm_optim._checks import check_number


class AdamW(torch.optim.Optimizer):
    """AdamW with the course's update order; parameter groups, ``state_dict`` and complex parameters work.

    ``foreach=None`` (the default) and ``True`` use the multi-tensor ``torch._foreach_*`` kernels;
    ``False`` updates one tensor at a time (same arithmetic). Parameters whose ``.grad`` is None are
    skipped; sparse gradients are refused with a ``TypeError``; complex parameters are updated as
    pairs of real numbers (as torch does). Per-parameter state: ``step`` (int), ``exp_avg`` (m),
    ``exp_avg_sq`` (v).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        foreach: bool | None = None,
    ) -> None:
        if foreach is not None and not isinstance(foreach, bool):
            raise TypeError(f"foreach must be None or a bool, got {type(foreach).__name__} {foreach!r}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "foreach": foreach}
        _check_group(defaults)
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_group(group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One AdamW step for every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_group(group)
            # Parameters are batched by (device, dtype, step): the step sets the bias correction.
            batches: dict[tuple[torch.device, torch.dtype, int], tuple[list[Tensor], ...]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("AdamW does not support sparse gradients, got a sparse gradient")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] = int(state["step"]) + 1
                tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])
                if torch.is_complex(p):
                    tensors = tuple(torch.view_as_real(t) for t in tensors)
                key = (tensors[0].device, tensors[0].dtype, state["step"])
                lists = batches.setdefault(key, ([], [], [], []))
                for lst, t in zip(lists, tensors, strict=True):
                    lst.append(t)
            update = _foreach_update if group["foreach"] in (None, True) else _single_tensor_update
            for (_, _, step), (params, grads, exp_avgs, exp_avg_sqs) in batches.items():
                update(params, grads, exp_avgs, exp_avg_sqs, step, group)
        return loss


def _check_group(group: dict[str, Any]) -> None:
    check_number("lr", group["lr"], low=0.0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    check_number("betas[0]", betas[0], low=0.0, high=1.0, high_open=True)
    check_number("betas[1]", betas[1], low=0.0, high=1.0, high_open=True)
    check_number("eps", group["eps"], low=0.0)
    check_number("weight_decay", group["weight_decay"], low=0.0)


def _coefficients(step: int, group: dict[str, Any]) -> tuple[float, float, float, float]:
    """(1 − β₁, β₂, −α_t·(1 − αλ), 1 − αλ) for this step and group."""
    lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
    alpha_t = lr * (1.0 - beta2**step) ** 0.5 / (1.0 - beta1**step)
    keep = 1.0 - lr * decay
    return 1.0 - beta1, beta2, -alpha_t * keep, keep


def _foreach_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: int,
    group: dict[str, Any],
) -> None:
    one_minus_beta1, beta2, step_size, keep = _coefficients(step, group)
    torch._foreach_lerp_(exp_avgs, grads, one_minus_beta1)  # m + (1-β₁)(g - m) = β₁m + (1-β₁)g
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, group["eps"])
    if keep != 1.0:
        torch._foreach_mul_(params, keep)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


def _single_tensor_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: int,
    group: dict[str, Any],
) -> None:
    one_minus_beta1, beta2, step_size, keep = _coefficients(step, group)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        m.lerp_(g, one_minus_beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = v.sqrt().add_(group["eps"])
        if keep != 1.0:
            p.mul_(keep)
        p.addcdiv_(m, denom, value=step_size)
