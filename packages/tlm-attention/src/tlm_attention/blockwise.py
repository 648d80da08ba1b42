"""Exact attention in O(seq) memory: online softmax over key blocks (Milakov & Gimelshein 2018;
the FlashAttention recurrence, Dao et al. 2022), written in plain PyTorch.

Scores never exist as a full queries × keys matrix: each query block walks the key blocks it may
see, keeping a running maximum, normaliser and weighted sum. With ``causal=True`` key blocks
wholly in a query block's future are skipped, which halves the work. The backward pass recomputes
the block scores from the saved log-sum-exp instead of storing them, so training memory stays
O(seq) as well.
"""

import math

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from tlm_core.checks import check_positive_int
from tlm_core.tensors import check_float_tensor

DEFAULT_BLOCK_SIZE = 256


def _key_limit(q_end: int, offset: int, num_keys: int, causal: bool) -> int:
    """One past the last key that queries [.., q_end) may attend to."""
    return min(num_keys, q_end + offset) if causal else num_keys


def _block_scores(
    q: Tensor, k: Tensor, scale: float, q_start: int, k_start: int, offset: int, causal: bool, mask: Tensor | None
) -> Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal and k_start + k.shape[-2] - 1 > q_start + offset:  # the block reaches past the diagonal
        rows = torch.arange(q_start, q_start + q.shape[-2], device=q.device).unsqueeze(-1) + offset
        cols = torch.arange(k_start, k_start + k.shape[-2], device=q.device)
        scores = scores.masked_fill(cols > rows, float("-inf"))
    if mask is not None:  # the block's part of a boolean mask (True = may attend)
        visible = mask[..., q_start : q_start + q.shape[-2], k_start : k_start + k.shape[-2]]
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, block_size: int, mask=None):  # type: ignore[no-untyped-def]
        scale = 1.0 / math.sqrt(q.shape[-1])
        num_q, num_k = q.shape[-2], k.shape[-2]
        offset = num_k - num_q  # bottom-right alignment: the last query sees every key
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        for qs in range(0, num_q, block_size):
            qe = min(qs + block_size, num_q)
            q_blk = q[..., qs:qe, :]
            running_max = torch.full((*q.shape[:-2], qe - qs, 1), float("-inf"), dtype=q.dtype, device=q.device)
            normaliser = torch.zeros_like(running_max)
            acc = torch.zeros(*q.shape[:-2], qe - qs, v.shape[-1], dtype=q.dtype, device=q.device)
            for ks in range(0, _key_limit(qe, offset, num_k, causal), block_size):
                ke = min(ks + block_size, _key_limit(qe, offset, num_k, causal))
                scores = _block_scores(q_blk, k[..., ks:ke, :], scale, qs, ks, offset, causal, mask)
                new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
                # A row with nothing visible yet keeps max -inf; shift it by 0 so exp gives 0, not NaN.
                safe_max = torch.where(torch.isneginf(new_max), 0.0, new_max)
                probs = torch.exp(scores - safe_max)
                correction = torch.exp(running_max - safe_max)
                normaliser = normaliser * correction + probs.sum(-1, keepdim=True)
                acc = acc * correction + torch.matmul(probs, v[..., ks:ke, :])
                running_max = new_max
            # Rows that saw no key keep max -inf and get zeros; a NaN anywhere stays NaN.
            seen = ~torch.isneginf(running_max)
            out[..., qs:qe, :] = torch.where(seen, acc / torch.where(seen, normaliser, 1.0), 0.0)
            lse[..., qs:qe] = torch.where(seen, running_max + torch.log(normaliser), float("-inf")).squeeze(-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_size, ctx.mask = causal, block_size, mask
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[no-untyped-def]
        q, k, v, out, lse = ctx.saved_tensors
        causal, block_size, mask = ctx.causal, ctx.block_size, ctx.mask
        scale = 1.0 / math.sqrt(q.shape[-1])
        num_q, num_k = q.shape[-2], k.shape[-2]
        offset = num_k - num_q
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        # D_i = Σ_j P_ij dP_ij = dO_i · O_i, the softmax-Jacobian term of each query row.
        delta = (grad_out * out).sum(-1, keepdim=True)
        for qs in range(0, num_q, block_size):
            qe = min(qs + block_size, num_q)
            q_blk, do_blk, d_blk = q[..., qs:qe, :], grad_out[..., qs:qe, :], delta[..., qs:qe, :]
            lse_blk = lse[..., qs:qe].unsqueeze(-1)
            lse_blk = torch.where(torch.isneginf(lse_blk), float("inf"), lse_blk)  # empty rows: P = 0
            for ks in range(0, _key_limit(qe, offset, num_k, causal), block_size):
                ke = min(ks + block_size, _key_limit(qe, offset, num_k, causal))
                k_blk, v_blk = k[..., ks:ke, :], v[..., ks:ke, :]
                probs = torch.exp(_block_scores(q_blk, k_blk, scale, qs, ks, offset, causal, mask) - lse_blk)
                grad_v[..., ks:ke, :] += torch.matmul(probs.transpose(-1, -2), do_blk)
                grad_scores = probs * (torch.matmul(do_blk, v_blk.transpose(-1, -2)) - d_blk) * scale
                grad_q[..., qs:qe, :] += torch.matmul(grad_scores, k_blk)
                grad_k[..., ks:ke, :] += torch.matmul(grad_scores.transpose(-1, -2), q_blk)
        return grad_q, grad_k, grad_v, None, None, None


def blockwise_attention(
    Q: Float[Tensor, "... queries d_k"],
    K: Float[Tensor, "... keys d_k"],
    V: Float[Tensor, "... keys d_v"],
    causal: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    mask: Bool[Tensor, "... queries keys"] | None = None,
) -> Float[Tensor, "... queries d_v"]:
    """softmax(Q Kᵀ / sqrt(d_k)) V without materialising the queries × keys matrix.

    ``causal`` masks bottom-right aligned: query i sees keys j <= i + (keys - queries), so the
    last query sees every key. That is ordinary causal attention when queries == keys, and the
    right mask for new tokens attending to a KV cache. Q, K and V must share their leading
    dimensions. Half-precision inputs are computed in float32 and returned in their dtype.

    ``mask`` (boolean, True = may attend, broadcasting to (..., queries, keys)) further restricts each
    query, block by block (a document mask, say): only the mask itself is whole, never the scores. A query
    that sees no key gets zeros, as :func:`~tlm_attention.scaled_dot_product_attention` gives it.
    """
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        check_float_tensor(name, t)
        if t.ndim < 2:
            raise ValueError(f"{name} must have shape (..., seq, dim), got {tuple(t.shape)}")
    if not (Q.shape[:-2] == K.shape[:-2] == V.shape[:-2]):
        raise ValueError(
            f"Q, K and V must share their leading dimensions, got Q {tuple(Q.shape)}, K {tuple(K.shape)}, "
            f"V {tuple(V.shape)}"
        )
    if Q.shape[-1] != K.shape[-1]:
        raise ValueError(f"Q and K must share their last dimension d_k, got Q {tuple(Q.shape)} and K {tuple(K.shape)}")
    if K.shape[-2] != V.shape[-2]:
        raise ValueError(f"K and V must have the same number of keys, got K {tuple(K.shape)} and V {tuple(V.shape)}")
    check_positive_int("block_size", block_size)
    compute = torch.promote_types(Q.dtype, torch.float32)
    if mask is not None and (not isinstance(mask, Tensor) or mask.dtype != torch.bool):
        raise TypeError(f"mask must be a boolean torch.Tensor or None, got {getattr(mask, 'dtype', type(mask))}")
    out = _BlockwiseAttention.apply(Q.to(compute), K.to(compute), V.to(compute), bool(causal), block_size, mask)
    return out.to(Q.dtype)
