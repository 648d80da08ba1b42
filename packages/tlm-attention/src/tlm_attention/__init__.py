"""Softmax, scaled dot-product attention and causal multi-head self-attention."""

from tlm_attention.blockwise import blockwise_attention
from tlm_attention.kv_cache import KVCache
from tlm_attention.mha import BACKENDS, CausalMultiHeadSelfAttention, causal_attention
from tlm_attention.sdpa import scaled_dot_product_attention
from tlm_attention.softmax import softmax

__version__ = "0.2.0"

__all__ = [
    "BACKENDS",
    "CausalMultiHeadSelfAttention",
    "KVCache",
    "__version__",
    "blockwise_attention",
    "causal_attention",
    "scaled_dot_product_attention",
    "softmax",
]
