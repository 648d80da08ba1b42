"""Attention implementations by name: a registry resolved once, when a module is built.

Every entry computes the same causal attention of (..., queries, d_head) over (..., keys, d_head),
bottom-right aligned: query i sees keys j <= i + (keys - queries). That is ordinary causal
attention when queries == keys, and new tokens attending to themselves and a KV cache otherwise.
``"auto"`` is not an entry: :func:`resolve_attention_backend` turns it into one, per device.
"""

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from tlm_attention.blockwise import blockwise_attention
from tlm_attention.sdpa import scaled_dot_product_attention

AttentionFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def _causal_mask(num_q: int, num_k: int, device: torch.device) -> Tensor:
    return torch.ones(num_q, num_k, dtype=torch.bool, device=device).tril(num_k - num_q)


def reference_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """tlm's own softmax(QKᵀ/√d)V with a boolean mask (what the course grades)."""
    return scaled_dot_product_attention(q, k, v, _causal_mask(q.shape[-2], k.shape[-2], q.device))


def blockwise_causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Online softmax over key blocks in plain PyTorch: O(seq) memory, future blocks skipped."""
    return blockwise_attention(q, k, v, causal=True)


def torch_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``: torch's fused kernels."""
    num_q, num_k = q.shape[-2], k.shape[-2]
    if num_q == num_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if num_q == 1:  # one new token sees the whole cache
        return F.scaled_dot_product_attention(q, k, v)
    # torch's is_causal aligns top-left, which is wrong once a cache offsets the queries.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_mask(num_q, num_k, q.device))


_REGISTRY: dict[str, AttentionFn] = {
    "reference": reference_attention,
    "blockwise": blockwise_causal_attention,
    "torch": torch_attention,
}

#: name -> implementation ``fn(q, k, v)``; read-only view (add entries with
#: :func:`register_attention_backend`).
ATTENTION_BACKENDS: Mapping[str, AttentionFn] = MappingProxyType(_REGISTRY)

#: The names tlm ships, plus "auto". In causal self-attention no row is ever fully masked, so
#: torch's NaN for such rows cannot occur and "auto" may pick torch's fused kernels.
BACKENDS = ("auto", "reference", "blockwise", "torch")

#: What "auto" means on each device type; any other device type gets "torch".
_AUTO = {"cpu": "torch", "cuda": "torch", "meta": "torch"}


def register_attention_backend(name: str, fn: AttentionFn) -> None:
    """Make ``fn(q, k, v)`` (causal, bottom-right aligned) available as ``attention_backend=name``.

    ``fn`` should be a module-level function so that modules using it still pickle.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"name must be a non-empty str other than 'auto', got {name!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if name in _REGISTRY:
        raise ValueError(f"attention backend {name!r} is already registered")
    _REGISTRY[name] = fn


def resolve_attention_backend(name: object, device: torch.device | str | None = None) -> str:
    """The registered name that ``name`` stands for on ``device``: ``"auto"`` becomes a concrete
    name; any other name must be registered. Raises ``ValueError`` for unknown names."""
    if not isinstance(name, str) or (name != "auto" and name not in _REGISTRY):
        raise ValueError(f"attention_backend must be one of {('auto', *_REGISTRY)}, got {name!r}")
    if name != "auto":
        return name
    device_type = torch.device(device if device is not None else torch.get_default_device()).type
    return _AUTO.get(device_type, "torch")


def causal_attention(
    q: Float[Tensor, "... queries d_head"],
    k: Float[Tensor, "... keys d_head"],
    v: Float[Tensor, "... keys d_head"],
    attention_backend: str = "auto",
) -> Float[Tensor, "... queries d_head"]:
    """Causal attention of (..., queries, d_head) over (..., keys, d_head), bottom-right aligned,
    computed by the named backend ("auto": resolved for ``q``'s device)."""
    return _REGISTRY[resolve_attention_backend(attention_backend, q.device)](q, k, v)
