"""Softmax, scaled dot-product attention and causal multi-head self-attention.

Names load on first use (PEP 562): ``from tlm_attention.heads import head_layout`` (the heads' sizes, with
their checks) costs no torch import, which a config that only states sizes relies on.
"""

from typing import TYPE_CHECKING

from tlm_core.lazy import lazy_exports

__version__ = "0.4.0"

__all__ = [
    "BACKENDS",
    "CacheStep",
    "CausalMultiHeadSelfAttention",
    "KVCache",
    "__version__",
    "attention_function",
    "blockwise_attention",
    "cache_mask",
    "causal_attention",
    "document_ids",
    "document_mask",
    "document_positions",
    "head_layout",
    "resolve_attention_backend",
    "scaled_dot_product_attention",
    "softmax",
]

_HOMES = {
    **dict.fromkeys(
        ("BACKENDS", "attention_function", "causal_attention", "resolve_attention_backend"), "tlm_attention.backends"
    ),
    "blockwise_attention": "tlm_attention.blockwise",
    **dict.fromkeys(("document_ids", "document_mask", "document_positions"), "tlm_attention.documents"),
    "head_layout": "tlm_attention.heads",
    **dict.fromkeys(("KVCache", "CacheStep", "cache_mask"), "tlm_attention.kv_cache"),
    "CausalMultiHeadSelfAttention": "tlm_attention.mha",
    "scaled_dot_product_attention": "tlm_attention.sdpa",
    "softmax": "tlm_attention.softmax",
}

if TYPE_CHECKING:
    from tlm_attention.backends import BACKENDS, attention_function, causal_attention, resolve_attention_backend
    from tlm_attention.blockwise import blockwise_attention
    from tlm_attention.documents import document_ids, document_mask, document_positions
    from tlm_attention.heads import head_layout
    from tlm_attention.kv_cache import CacheStep, KVCache, cache_mask
    from tlm_attention.mha import CausalMultiHeadSelfAttention
    from tlm_attention.sdpa import scaled_dot_product_attention
    from tlm_attention.softmax import softmax


lazy_exports(__name__, _HOMES)
