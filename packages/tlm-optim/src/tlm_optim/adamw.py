"""AdamW as CS336 assignment 1 (§4.3, Algorithm 2) writes it, after Loshchilov & Hutter (2019).

For each parameter θ with gradient g, at step t = 1, 2, ...:

    m ← β₁ m + (1 − β₁) g
    v ← β₂ v + (1 − β₂) g²
    α_t = α · √(1 − β₂ᵗ) / (1 − β₁ᵗ)
    θ ← θ − α_t · m / (√v + ε)
    θ ← θ − α λ θ                      (decoupled weight decay, applied AFTER the Adam update)

torch.optim.AdamW differs in two small ways: it decays θ *before* the Adam update (the two orders
differ by α·λ·α_t·m/(√v+ε) per step), and it adds ε to √v / √(1 − β₂ᵗ) rather than to √v.

Both fast paths fold the decay into the update: θ·(1 − αλ) − α_t (1 − αλ)·u equals
(θ − α_t u)(1 − αλ), the course's order. The multi-tensor path (``torch._foreach_*``) makes one
pass over θ fewer than torch's foreach AdamW. The fused path runs torch's one-pass AdamW kernel
(``torch._fused_adamw_``, on CPU and CUDA) with its arguments re-parametrised so that it computes
the course's update instead of torch's: with lr' = α(1 − αλ), weight_decay' = λ / (1 − αλ) and
eps' = ε / √(1 − β₂ᵗ), torch's θ(1 − lr'λ') − lr'/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + eps') is exactly
(θ − α_t · m / (√v + ε))(1 − αλ).
"""

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from tlm_core.checks import check_number


class _Batch(NamedTuple):
    """The tensors one update call takes, index-aligned: parameters on one device, of one dtype and step."""

    params: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]


class AdamW(torch.optim.Optimizer):
    """AdamW with the course's update order; parameter groups, ``state_dict`` and complex parameters work.

    ``fused=None`` (the default) uses torch's fused kernel where it exists for the parameters'
    device and dtype (CPU and CUDA floating point), else the multi-tensor ``torch._foreach_*``
    path; ``fused=False`` with ``foreach=None``/``True`` forces the multi-tensor path, and
    ``foreach=False`` updates one tensor at a time. All paths compute the same algorithm (tested
    against one float64 re-derivation); they may differ in the last bits. Parameters whose ``.grad`` is None are
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
        *,
        fused: bool | None = None,
    ) -> None:
        for name, flag in (("foreach", foreach), ("fused", fused)):
            if flag is not None and not isinstance(flag, bool):
                raise TypeError(f"{name} must be None or a bool, got {type(flag).__name__} {flag!r}")
        if fused and foreach is not None:
            raise ValueError(f"fused=True runs its own kernel; leave foreach=None, got foreach={foreach}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "foreach": foreach,
            "fused": fused,
        }
        _check_group(defaults)
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_group(group)
        # The fused kernel reads the step from a tensor on the parameters' device: one 0-d float32 counter per
        # device, advanced there by add_(1) (no host-to-device copy in a step), made again by a fill kernel when
        # the host count moved otherwise (the first step, a loaded state, a rewind).
        self._device_steps: dict[torch.device, tuple[int, Tensor]] = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure: Any = None, *, found_inf: Tensor | None = None) -> Any:
        """One AdamW step for every parameter that has a gradient; returns ``closure()`` if given.

        ``found_inf`` (a 0-d float tensor on the parameters' device, as torch's fused optimizers and
        ``GradScaler`` take it): where it is non-zero the update is skipped on the device, parameters and
        moments left bit-for-bit as they were, with no read back to the host. The step counters are
        host integers and still advance; the caller that later reads the flag winds them back
        (``tlm_train.NonFiniteGuard`` does). The fused kernel takes the flag itself; the other paths
        compute the update and keep the old values where the flag is set.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # The groups were checked when they were added (the constructor, add_param_group); a step
        # trusts them, as it trusts a schedule that sets "lr".
        for group in self.param_groups:
            # Parameters are batched by (device, dtype, step): the step sets the bias correction.
            batches: dict[tuple[torch.device, torch.dtype, int], _Batch] = {}
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
                tensors: tuple[Tensor, ...] = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])
                if torch.is_complex(p):
                    tensors = tuple(torch.view_as_real(t) for t in tensors)
                key = (tensors[0].device, tensors[0].dtype, state["step"])
                batch = batches.setdefault(key, _Batch([], [], [], []))
                for lst, t in zip(batch, tensors, strict=True):
                    lst.append(t)
            for (device, dtype, step), batch in batches.items():
                update = _choose(group, device, dtype)
                if update is _fused_update and found_inf is None:
                    _fused_update(batch, step, group, None, self._device_step(device, step))
                elif found_inf is None:
                    update(batch, step, group)
                elif update is _fused_update:
                    _fused_update(batch, step, group, found_inf, self._device_step(device, step))
                else:
                    _skippable(update, batch, step, group, found_inf)
        return loss

    def _device_step(self, device: torch.device, step: int) -> Tensor:
        """``step`` as a 0-d float32 tensor on ``device``, for the fused kernel, made without a host copy."""
        cached = self._device_steps.get(device)
        if cached is not None and cached[0] == step:
            return cached[1]
        if cached is not None and cached[0] == step - 1 and step < 2**24:  # float32 counts exactly to 2**24
            counter = cached[1].add_(1)
        else:
            counter = torch.full((), float(step), dtype=torch.float32, device=device)  # a fill, not a copy
        self._device_steps[device] = (step, counter)
        return counter

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_device_steps", {})


_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _choose(group: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    fused, foreach = group.get("fused"), group.get("foreach")
    keep = 1.0 - group["lr"] * group["weight_decay"]
    can_fuse = device.type in _FUSED_DEVICES and dtype in _FUSED_DTYPES and keep > 0.0
    if fused:
        if not can_fuse:
            raise ValueError(
                f"fused=True needs parameters on {_FUSED_DEVICES} in {_FUSED_DTYPES} and lr·weight_decay < 1, "
                f"got {device.type} {dtype} and lr·weight_decay={1.0 - keep}"
            )
        return _fused_update
    if fused is None and foreach is None and can_fuse:
        return _fused_update
    return _single_tensor_update if foreach is False else _foreach_update


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


def _foreach_update(batch: _Batch, step: int, group: dict[str, Any]) -> None:
    params, grads, exp_avgs, exp_avg_sqs = batch
    one_minus_beta1, beta2, step_size, keep = _coefficients(step, group)
    torch._foreach_lerp_(exp_avgs, grads, one_minus_beta1)  # m + (1-β₁)(g - m) = β₁m + (1-β₁)g
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, group["eps"])
    if keep != 1.0:
        torch._foreach_mul_(params, keep)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


def _single_tensor_update(batch: _Batch, step: int, group: dict[str, Any]) -> None:
    params, grads, exp_avgs, exp_avg_sqs = batch
    one_minus_beta1, beta2, step_size, keep = _coefficients(step, group)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        m.lerp_(g, one_minus_beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = v.sqrt().add_(group["eps"])
        if keep != 1.0:
            p.mul_(keep)
        p.addcdiv_(m, denom, value=step_size)


def _skippable(update: Any, batch: _Batch, step: int, group: dict[str, Any], found_inf: Tensor) -> None:
    # The unfused paths update in place; where found_inf is set, the values from before are put back.
    kept = [t.clone() for t in (*batch.params, *batch.exp_avgs, *batch.exp_avg_sqs)]
    update(batch, step, group)
    skip = found_inf.to(torch.bool)
    for t, old in zip((*batch.params, *batch.exp_avgs, *batch.exp_avg_sqs), kept, strict=True):
        t.copy_(torch.where(skip, old, t))


def _fused_update(
    batch: _Batch, step: int, group: dict[str, Any], found_inf: Tensor | None = None, counter: Tensor | None = None
) -> None:
    """``counter``: ``step`` as a 0-d float32 tensor on the parameters' device (made here when None)."""
    params, grads, exp_avgs, exp_avg_sqs = batch
    lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
    keep = 1.0 - lr * decay  # > 0, checked by _choose
    if counter is None:
        counter = torch.full((), float(step), dtype=torch.float32, device=params[0].device)
    steps = [counter] * len(params)
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=lr * keep,
        beta1=beta1,
        beta2=beta2,
        weight_decay=decay / keep,
        eps=group["eps"] / (1.0 - beta2**step) ** 0.5,
        amsgrad=False,
        maximize=False,
        found_inf=None if found_inf is None else found_inf.to(device=params[0].device, dtype=torch.float32),
    )
