"""The three attention implementations, by name: ``attention_function(name)``, looked up once when a module
is built.

Each computes the same causal attention of (..., heads, queries, d_head) over
(..., kv_heads, keys, d_head), bottom-right aligned: query i sees keys j <= i + (keys - queries).
That is ordinary causal attention when queries == keys, and new tokens attending to themselves and
a KV cache otherwise. ``kv_heads`` divides ``heads`` (grouped-query attention, Ainslie et al. 2023):
query head h reads key/value head h // (heads / kv_heads), as in HF's ``repeat_kv``.
``"auto"`` names none of them: :func:`resolve_attention_backend` turns it into ``"torch"``.

Rows of different lengths in a KV cache need more than one causal offset: then one is called with
``mask=`` a boolean (..., 1, queries, keys) tensor (True = may attend) that replaces the causal mask.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from tlm_attention.blockwise import blockwise_attention
from tlm_attention.sdpa import scaled_dot_product_attention

AttentionFn = Callable[..., Tensor]


def _causal_mask(num_q: int, num_k: int, device: torch.device) -> Tensor:
    return torch.ones(num_q, num_k, dtype=torch.bool, device=device).tril(num_k - num_q)


def _kv_groups(q: Tensor, k: Tensor, v: Tensor) -> int:
    """How many query heads share each key/value head (1 for ordinary multi-head attention)."""
    if q.ndim < 3 or k.ndim < 3 or k.shape[-3] != v.shape[-3] or q.shape[-3] % k.shape[-3] != 0:
        raise ValueError(
            "q must have shape (..., heads, queries, d_head) and k, v (..., kv_heads, keys, d_head) with kv_heads "
            f"dividing heads, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    return q.shape[-3] // k.shape[-3]


def repeat_kv(kv: Float[Tensor, "... kv_heads keys d_head"], groups: int) -> Float[Tensor, "... heads keys d_head"]:
    """Each key/value head repeated ``groups`` times in place (head h -> heads h·groups .. h·groups+groups-1)."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """tlm's own softmax(QKᵀ/√d)V with a boolean mask (what the course grades)."""
    groups = _kv_groups(q, k, v)
    mask = _causal_mask(q.shape[-2], k.shape[-2], q.device) if mask is None else mask
    if groups == 1:
        return scaled_dot_product_attention(q, k, v, mask)
    # Grouped: a unit axis lets one kv head broadcast over its query heads without a copy.
    grouped = rearrange(q, "... (kv_heads group) seq d -> ... kv_heads group seq d", group=groups)
    mask = mask if mask.ndim < 3 else mask.unsqueeze(-3)
    out = scaled_dot_product_attention(grouped, k.unsqueeze(-3), v.unsqueeze(-3), mask)
    return rearrange(out, "... kv_heads group seq d -> ... (kv_heads group) seq d")


def blockwise_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *, causal_mask: bool = False
) -> Tensor:
    """Online softmax over key blocks in plain PyTorch: O(seq) memory, future blocks skipped.

    With a ``mask`` over as many queries as keys (a packed window's document mask) the mask replaces the
    causal one block by block, so memory stays O(seq); every key block is visited unless ``causal_mask``
    says the mask is within the causal one (as a document mask is), when future blocks are skipped too.
    With a mask over a few queries (decoding rows of different lengths) the scores are small and computed
    whole by :func:`scaled_dot_product_attention`."""
    groups = _kv_groups(q, k, v)
    if mask is not None and q.shape[-2] == k.shape[-2]:
        return blockwise_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), causal=causal_mask, mask=mask)
    if mask is not None:
        return scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), mask)
    return blockwise_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), causal=True)


def _one_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Masked attention of one query a row as two batched matmuls and a softmax (float32 scores): a decode
    step's, where torch's fused CPU kernel costs more than the arithmetic (it tiles for long queries). A
    grouped kv head's query heads become its queries, so nothing is repeated."""
    groups = q.shape[-3] // k.shape[-3]
    queries = q.unflatten(-3, (k.shape[-3], groups)).squeeze(-2)  # (..., kv_heads, group, d_head)
    scores = (queries @ k.transpose(-1, -2)).float() * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, float("-inf"))  # mask (..., 1, 1, keys): the same for every head
    out = torch.softmax(scores, dim=-1).to(v.dtype) @ v
    return out.flatten(-3, -2).unsqueeze(-2)


def torch_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``: torch's fused kernels. On a CPU, one masked query
    a row (a decode step over rows of different lengths) is :func:`_one_query_attention`'s two matmuls instead
    (docs/benchmarks.md has the timing)."""
    gqa = _kv_groups(q, k, v) > 1
    if mask is not None and q.shape[-2] == 1 and q.device.type == "cpu" and (mask.ndim < 3 or mask.shape[-3] == 1):
        return _one_query_attention(q, k, v, mask)
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    num_q, num_k = q.shape[-2], k.shape[-2]
    if num_q == num_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if num_q == 1:  # one new token sees the whole cache
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    # torch's is_causal aligns top-left, which is wrong once a cache offsets the queries.
    mask = _causal_mask(num_q, num_k, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


#: The names ``attention_backend`` takes: tlm's three implementations, and "auto". In causal self-attention no
#: row is ever fully masked, so torch's NaN for such rows cannot occur and "auto" may pick torch's fused kernels.
BACKENDS = ("auto", "reference", "blockwise", "torch")


def resolve_attention_backend(name: object) -> str:
    """The implementation ``name`` stands for: ``"auto"`` is ``"torch"`` on every device (torch's fused SDPA
    picks its own kernel per device); any other name must be one of :data:`BACKENDS`, else ``ValueError``."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    return "torch" if name == "auto" else name


def _blockwise_within_causal(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    return blockwise_causal_attention(q, k, v, mask, causal_mask=True)


def attention_function(name: str, *, within_causal: bool = False) -> AttentionFn:
    """The implementation ``fn(q, k, v, mask=None)`` of backend ``name`` (resolved: not "auto"). With
    ``within_causal``, for a ``mask`` known to lie within the causal one (a document mask): the same function,
    except that blockwise then skips future blocks."""
    match resolve_attention_backend(name):
        case "reference":
            return reference_attention
        case "blockwise":
            return _blockwise_within_causal if within_causal else blockwise_causal_attention
        case _:
            return torch_attention


def causal_attention(
    q: Float[Tensor, "... heads queries d_head"],
    k: Float[Tensor, "... kv_heads keys d_head"],
    v: Float[Tensor, "... kv_heads keys d_head"],
    attention_backend: str = "auto",
) -> Float[Tensor, "... heads queries d_head"]:
    """Causal attention of (..., heads, queries, d_head) over (..., kv_heads, keys, d_head),
    bottom-right aligned, computed by the named backend (one of :data:`BACKENDS`).
    ``kv_heads`` must divide ``heads``; query head h reads kv head h // (heads / kv_heads)."""
    return attention_function(attention_backend)(q, k, v)
