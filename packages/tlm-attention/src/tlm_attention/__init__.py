"""Softmax, scaled dot-product attention and causal multi-head self-attention."""

from tlm_attention.mha import CausalMultiHeadSelfAttention
from tlm_attention.sdpa import scaled_dot_product_attention
from tlm_attention.softmax import softmax

__version__ = "0.1.0"

__all__ = ["CausalMultiHeadSelfAttention", "__version__", "scaled_dot_product_attention", "softmax"]
