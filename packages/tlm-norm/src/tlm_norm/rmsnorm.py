"""RMSNorm (Zhang & Sennrich 2019, eq. 4) as used in LLaMA: x / sqrt(mean(x²) + eps) · g."""

import torch
from jaxtyping import Float
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from tlm_core.checks import check_number, check_positive_int
from tlm_core.tensors import check_float_tensor


class RMSNorm(nn.Module):
    """Normalises the last dimension by its root mean square and scales by a learned gain.

    The reduction runs in float32, or in float64 for float64 input, so that squaring
    float16/bfloat16 activations neither overflows nor loses the small ones; the result is
    cast back to the input dtype. A row whose mean square overflows is scaled by c = 1 / max|x| before
    squaring (x / sqrt(mean(x²) + eps) = cx / sqrt(mean((cx)²) + c²·eps) for any c > 0), so any
    finite input, up to the dtype's largest value, gives a finite, correct result. The gain
    ``weight`` (d_model,) starts at ones.

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
        check_float_tensor("x", x)
        if x.ndim == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have last dimension d_model={self.d_model}, got shape {tuple(x.shape)}")
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        return _rms_norm(x, self.weight, self.eps)[0]

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, eps={self.eps}"


def _inv_rms(x: Tensor, eps: float) -> Tensor:
    """1 / sqrt(mean(x²) + eps) over the last dimension (keepdim), finite for every finite row."""
    mean_square = x.square().mean(dim=-1, keepdim=True)
    overflow = mean_square.isinf()
    # On the CPU reading one flag per call costs nothing; elsewhere (and under torch.compile) both
    # forms are computed and selected per row, so the forward never waits for the device.
    if x.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(overflow.any()):
        return torch.rsqrt(mean_square.add_(eps))
    # c = 1 / max(1, max|x|) per row; any c > 0 gives the same value, so it need not be rounded exactly.
    # amax and amin, not aminmax: along a dimension torch's CPU aminmax is ~20x slower than the two.
    c = torch.maximum(x.amax(dim=-1, keepdim=True), -x.amin(dim=-1, keepdim=True)).clamp_(min=1.0).reciprocal_()
    scaled = c * torch.rsqrt((x * c).square().mean(dim=-1, keepdim=True) + eps * c.square())
    return torch.where(overflow, scaled, torch.rsqrt(mean_square + eps))


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
        compute_dtype = r.dtype
        x_hat = x.to(compute_dtype) * r
        grad = grad.to(compute_dtype)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            # y = w·x·r with r = (mean(x²) + eps)^(-1/2):  dL/dx = r · (g·w − x̂ · mean(g·w·x̂)), x̂ = x·r.
            gw = grad * weight.to(compute_dtype)
            mean_gw_x_hat = torch.linalg.vecdot(gw, x_hat, dim=-1).unsqueeze(-1).div_(x.shape[-1])
            grad_x = gw.addcmul_(x_hat, mean_gw_x_hat, value=-1).mul_(r).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_weight, None
