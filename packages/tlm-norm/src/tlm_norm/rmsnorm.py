"""RMSNorm (Zhang & Sennrich 2019, eq. 4) as used in LLaMA: x / sqrt(mean(x²) + eps) · g."""

import torch
from jaxtyping import Float
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from tlm_core.checks import check_number, check_positive_int


class RMSNorm(nn.Module):
    """Normalises the last dimension by its root mean square and scales by a learned gain.

    The normalisation runs in float32 (float64 for float64 input) and the result is cast back to the
    input dtype once; the squares are summed in float64, where the square of any float32 or bfloat16
    value neither overflows nor underflows, so any finite input, up to the dtype's largest value,
    gives a finite, correct result, in one pass and with no branch on the data. The gain ``weight``
    (d_model,) starts at ones.

    ``forward`` checks nothing itself (the annotation states the shape; a wrong last dimension fails
    to broadcast against the gain) and never reads a value back to the host.

    Under autograd the backward pass is written out (one function, not a dozen recorded ops), and
    only the input and the per-row 1/rms are saved for it.
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
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        if x.dtype == torch.float16 and x.device.type != "mps":
            # float32 accumulation suffices for float16: a square is at most 65504² ≈ 4.3e9 and at least
            # (6e-8)² ≈ 3.6e-15, so no sum of them over- or underflows float32. torch's own (fused) kernel then.
            return F.rms_norm(x.float(), (self.d_model,), self.weight.float(), self.eps).to(x.dtype)
        return _rms_norm(x, self.weight, self.eps)[0]

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, eps={self.eps}"


def _inv_rms(x: Tensor, eps: float) -> Tensor:
    """1 / sqrt(mean(x²) + eps) over the last dimension (keepdim) in x's dtype, finite for every finite row."""
    if x.dtype != torch.float64 and x.device.type != "mps":
        # float32 squares lie between 1e-90 and 1e77, all normal float64 numbers: summed in float64
        # they neither overflow nor flush a row of small values to zero.
        sum_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float64).square_()
        return sum_sq.div_(x.shape[-1]).add_(eps).rsqrt_().to(x.dtype)
    # No wider type (float64 input, or MPS, which has no float64): scale each row by c = 1 / max(1, max|x|),
    # x / sqrt(mean(x²) + eps) = c·x / sqrt(mean((c·x)²) + c²·eps) for any c > 0.
    c = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).clamp_(min=1.0).reciprocal_()
    sum_sq = torch.linalg.vector_norm(x * c, dim=-1, keepdim=True).square_()
    return sum_sq.div_(x.shape[-1]).add_(c.square().mul_(eps)).rsqrt_().mul_(c)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The normalised, scaled ``x`` in x's dtype, and 1/rms per row in the compute dtype."""
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(compute_dtype)
    inv_rms = _inv_rms(x32, eps)
    return (x32 * inv_rms).mul_(weight.to(compute_dtype)).to(x.dtype), inv_rms


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with its backward written out; saves x and 1/rms (r), not the intermediates."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[no-untyped-def]
        out, inv_rms = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, inv_rms)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        x, weight, r = ctx.saved_tensors
        compute_dtype, d = r.dtype, x.shape[-1]
        w = weight.to(compute_dtype)
        # y = w·x̂ with x̂ = x·r, r = (mean(x²) + eps)^(-1/2):
        #   dL/dw = Σ_rows g·x̂,   dL/dx = r · (g·w − x̂ · mean(g·w·x̂)).
        # Both reductions read the one product g·x̂: a column sum, and a matrix-vector product with w.
        grad, x_hat = grad.to(compute_dtype), x.to(compute_dtype) * r
        g_x_hat = (grad * x_hat).reshape(-1, d)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            mean_gw_x_hat = (g_x_hat @ w).div_(d).view(r.shape)
            grad_x = x_hat.mul_(mean_gw_x_hat.neg_()).addcmul_(grad, w).mul_(r).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = g_x_hat.sum(0).to(weight.dtype)
        return grad_x, grad_weight, None
