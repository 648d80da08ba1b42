"""RMSNorm (Zhang & Sennrich 2019, eq. 4) as used in LLaMA: x / sqrt(mean(x²) + eps) · g."""

import torch
from jaxtyping import Float
from torch import Tensor, nn

from tlm_core.checks import check_number, check_positive_int
from tlm_core.tensors import check_float_tensor


class RMSNorm(nn.Module):
    """Normalises the last dimension by its root mean square and scales by a learned gain.

    The reduction runs in float32, or in float64 for float64 input, so that squaring
    float16/bfloat16 activations neither overflows nor loses the small ones; the result is
    cast back to the input dtype. Rows whose largest magnitude exceeds 1 are scaled by its inverse c
    before squaring (x / sqrt(mean(x²) + eps) = cx / sqrt(mean((cx)²) + c²·eps) for any c > 0), so any
    finite input, up to the dtype's largest value, gives a finite, correct result. The gain
    ``weight`` (d_model,) starts at ones.
    """

    def __init__(
        self,
        d_model: int,
        eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = check_positive_int("d_model", d_model)
        self.eps = check_number("eps", eps, low=0.0)
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        check_float_tensor("x", x)
        if x.ndim == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have last dimension d_model={self.d_model}, got shape {tuple(x.shape)}")
        in_dtype = x.dtype
        compute_dtype = torch.promote_types(in_dtype, torch.float32)
        x32 = x.to(compute_dtype)
        # c = 1 / max(1, max|x|) per row. The result does not depend on c (any c > 0 gives the same
        # value), so c needs no gradient and need not be rounded exactly.
        low, high = torch.aminmax(x32.detach(), dim=-1, keepdim=True)
        c = torch.maximum(high, -low).clamp(min=1.0).reciprocal()
        y = x32 * c
        inv_rms = torch.rsqrt(y.square().mean(dim=-1, keepdim=True) + self.eps * c.square())
        return (y * inv_rms * self.weight.to(compute_dtype)).to(in_dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, eps={self.eps}"
