"""Numerically stable softmax: subtract the maximum before exponentiating."""

import torch
from jaxtyping import Float
from torch import Tensor

from tlm_core.checks import check_int
from tlm_core.tensors import check_float_tensor


def softmax(x: Float[Tensor, "..."], dim: int) -> Float[Tensor, "..."]:
    """softmax(x)_i = exp(x_i - max x) / Σ_j exp(x_j - max x) along ``dim``.

    Shifting by the maximum leaves the result unchanged and keeps every exponent <= 0, so
    nothing overflows. float16/bfloat16 input is reduced in float32 and cast back.

    Unlike ``torch.softmax``, a slice whose entries are all -inf (nothing to attend to)
    returns zeros rather than NaN, and its gradient is zero rather than NaN.
    """
    check_float_tensor("x", x)
    check_int("dim", dim)
    rank = max(x.ndim, 1)
    if not -rank <= dim < rank:
        raise ValueError(f"dim must be in [{-rank}, {rank - 1}] for a tensor of rank {x.ndim}, got {dim}")

    if x.numel() == 0:  # an empty slice has nothing to normalise (torch.softmax agrees)
        return x.clone()
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    peak = x32.amax(dim=dim, keepdim=True)
    # An all -inf slice has peak -inf and (-inf) - (-inf) = NaN; shifting it by 0 instead
    # makes every exponential exactly 0.
    peak = torch.where(torch.isneginf(peak), torch.zeros_like(peak), peak).detach()
    exp = torch.exp(x32 - peak)
    total = exp.sum(dim=dim, keepdim=True)
    total = torch.where(total == 0, torch.ones_like(total), total)
    return (exp / total).to(x.dtype)
