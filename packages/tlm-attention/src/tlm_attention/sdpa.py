"""Scaled dot-product attention (Vaswani et al. 2017, eq. 1) with a boolean mask."""

import math

import torch
from einops import einsum
from jaxtyping import Bool, Float
from torch import Tensor

from tlm_attention.softmax import softmax
from tlm_core.tensors import check_float_tensor


def _check_mask(mask: object, scores_shape: torch.Size) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor of dtype torch.bool, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"mask must have dtype torch.bool (True = may attend), got {mask.dtype}; "
            f"an additive float mask is not supported"
        )
    if mask.ndim < 2:
        raise ValueError(f"mask must have shape (..., queries, keys), got {tuple(mask.shape)}")
    try:
        torch.broadcast_shapes(mask.shape, scores_shape)
    except RuntimeError:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (..., queries, keys) = {tuple(scores_shape)}"
        ) from None


def scaled_dot_product_attention(
    Q: Float[Tensor, "... queries d_k"],
    K: Float[Tensor, "... keys d_k"],
    V: Float[Tensor, "... keys d_v"],
    mask: Bool[Tensor, "... queries keys"] | None = None,
) -> Float[Tensor, "... queries d_v"]:
    """softmax(Q Kᵀ / sqrt(d_k)) V, where ``mask[..., i, j]`` True lets query i attend to key j.

    Leading dimensions of Q, K, V and mask broadcast against each other. A query whose mask
    row is all False gets an output of zeros and zero gradients (``torch``'s fused SDPA
    returns NaN there). With no keys at all every query gets zeros, for the same reason.
    """
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        check_float_tensor(name, t)
        if t.ndim < 2:
            raise ValueError(f"{name} must have shape (..., seq, dim), got {tuple(t.shape)}")
    if Q.shape[-1] != K.shape[-1]:
        raise ValueError(f"Q and K must share their last dimension d_k, got Q {tuple(Q.shape)} and K {tuple(K.shape)}")
    if K.shape[-2] != V.shape[-2]:
        raise ValueError(
            f"K and V must have the same number of keys (dim -2), got K {tuple(K.shape)} and V {tuple(V.shape)}"
        )

    try:
        lead = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"the leading (batch-like) dimensions of Q {tuple(Q.shape)}, K {tuple(K.shape)} and "
            f"V {tuple(V.shape)} do not broadcast together"
        ) from None
    if mask is not None:
        _check_mask(mask, torch.Size((*lead, Q.shape[-2], K.shape[-2])))

    scores = einsum(Q, K, "... queries d_k, ... keys d_k -> ... queries keys") / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = torch.where(mask, scores, float("-inf"))
    weights = softmax(scores, dim=-1)
    return einsum(weights, V, "... queries keys, ... keys d_v -> ... queries d_v")
