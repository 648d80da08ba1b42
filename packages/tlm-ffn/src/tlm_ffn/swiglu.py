"""SwiGLU feed-forward (Shazeer 2020): W2 (SiLU(W1 x) ⊙ W3 x)."""

import math

import torch
from jaxtyping import Float
from torch import Tensor, nn

from tlm_core.tensors import check_float_tensor
from tlm_ffn.options import checked_d_ff
from tlm_linear import Linear, register_split_layout


def silu(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    """SiLU / Swish: x · σ(x). torch.sigmoid saturates cleanly, so large |x| stays finite."""
    check_float_tensor("x", x)
    return x * torch.sigmoid(x)


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up that saves only gate and up for backward (the unfused graph would also keep
    σ(gate) and silu(gate) alive: two more d_ff-wide activations per token)."""

    @staticmethod
    def forward(ctx, gate, up):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(gate, up)
        return _silu_mul_one_buffer(gate, up)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        act = gate * sig
        # d silu(g)/dg = σ(g) (1 + g (1 - σ(g))) = σ + silu − silu·σ; three buffers, seven passes.
        d_silu = torch.addcmul(act, act, sig, value=-1).add_(sig)
        return d_silu.mul_(grad).mul_(up), act.mul_(grad)


def silu_mul(gate: Float[Tensor, "..."], up: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    """``silu(gate) * up``, the SwiGLU gating, with less memory than the two ops apart.

    The result is built in its own output buffer with no other temporary, and under autograd
    only ``gate`` and ``up`` are saved; the inputs are never modified.
    """
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up)
    return _silu_mul_one_buffer(gate, up)


def _silu_mul_one_buffer(gate: Tensor, up: Tensor) -> Tensor:
    # σ(gate) · gate · up built in the output buffer: no other d_ff-wide temporary.
    return torch.sigmoid(gate).mul_(gate).mul_(up)


class SwiGLU(nn.Module):
    """FFN(x) = w2(silu(w1(x)) * w3(x)) with w1, w3: d_model → d_ff and w2: d_ff → d_model.

    ``fused=True`` (the default) stores w1 and w3 as one (2·d_ff, d_model) matrix ``w13`` and runs them as a
    single matmul; state dicts still use (and accept) the separate ``w1.weight``/``w3.weight``. Either
    way the gating is :func:`silu_mul`, which keeps only the two d_ff-wide inputs for backward.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        fused: bool = True,
    ) -> None:
        super().__init__()
        d_ff = checked_d_ff(d_model, d_ff, kind="swiglu")
        if fused:
            # Each half keeps the σ² = 2/(d_model + d_ff) that a separate w1 or w3 would have.
            std = math.sqrt(2.0 / (d_model + d_ff))
            self.w13 = Linear(d_model, 2 * d_ff, device=device, dtype=dtype, init_std=std)
            register_split_layout(self, "w13", {"w1": d_ff, "w3": d_ff})
        else:
            self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
            self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.d_model = d_model
        self.d_ff = d_ff
        self.fused = fused

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        if self.fused:
            gate, up = self.w13(x).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(silu_mul(gate, up))
