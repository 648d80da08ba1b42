"""Softmax, scaled dot-product attention and causal multi-head self-attention."""

from tlm_attention.backends import (
    ATTENTION_BACKENDS,
    BACKENDS,
    causal_attention,
    register_attention_backend,
    resolve_attention_backend,
)
from tlm_attention.blockwise import blockwise_attention
from tlm_attention.kv_cache import KVCache
from tlm_attention.mha import CausalMultiHeadSelfAttention
from tlm_attention.sdpa import scaled_dot_product_attention
from tlm_attention.softmax import softmax

__version__ = "0.4.0"

__all__ = [
    "ATTENTION_BACKENDS",
    "BACKENDS",
    "CausalMultiHeadSelfAttention",
    "KVCache",
    "__version__",
    "blockwise_attention",
    "causal_attention",
    "register_attention_backend",
    "resolve_attention_backend",
    "scaled_dot_product_attention",
    "softmax",
]
