"""SwiGLU feed-forward (Shazeer 2020): W2 (SiLU(W1 x) ⊙ W3 x)."""

import torch
from jaxtyping import Float
from torch import Tensor, nn

from tlm_linear import Linear


def silu(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    """SiLU / Swish: x · σ(x). torch.sigmoid saturates cleanly, so large |x| stays finite."""
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    return x * torch.sigmoid(x)


def default_d_ff(d_model: int, multiple_of: int = 64) -> int:
    """The hidden width SwiGLU uses when none is given: 8/3 · d_model rounded up to ``multiple_of``.

    8/3 keeps the parameter count of a 4·d_model two-matrix FFN with three matrices; the
    rounding keeps matrix shapes friendly to hardware tiles.
    """
    for name, value in (("d_model", d_model), ("multiple_of", multiple_of)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    # Integer ceil-division avoids float rounding for large d_model.
    return multiple_of * -(-(8 * d_model) // (3 * multiple_of))


class SwiGLU(nn.Module):
    """FFN(x) = w2(silu(w1(x)) * w3(x)) with w1, w3: d_model → d_ff and w2: d_ff → d_model."""

    def __init__(
        self,
        d_model: int,
        d_ff: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if d_ff is None:
            d_ff = default_d_ff(d_model)
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.d_model = d_model
        self.d_ff = d_ff

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self.w2(silu(self.w1(x)) * self.w3(x))
