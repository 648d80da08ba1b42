"""The two-matrix SiLU feed-forward of CS336 §7's ablation: W2 SiLU(W1 x), no gate."""

import torch
from jaxtyping import Float
from torch import Tensor, nn

from tlm_ffn.options import checked_d_ff
from tlm_linear import Linear


class SiLUFFN(nn.Module):
    """FFN(x) = w2(silu(w1(x))) with w1: d_model → d_ff and w2: d_ff → d_model.

    The position-wise FFN of the original Transformer with SiLU in place of ReLU: what SwiGLU
    (:class:`~tlm_ffn.SwiGLU`) is measured against. ``d_ff`` defaults to 4 · d_model, so it holds
    2 · d_model · d_ff = 8 · d_model² parameters, about those of a SwiGLU at its default 8/3 · d_model
    (3 · d_model · d_ff). State-dict keys: ``w1.weight`` (d_ff, d_model) and ``w2.weight`` (d_model, d_ff),
    each initialised as a :class:`tlm_linear.Linear`.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        d_ff = checked_d_ff(d_model, d_ff, kind="silu")
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.d_model = d_model
        self.d_ff = d_ff

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        hidden = self.w1(x)
        # silu written out rather than tlm_ffn.silu, whose argument check has no place on a forward path.
        return self.w2(hidden * torch.sigmoid(hidden))
