"""Rotary positional embedding (RoPE, Su et al. 2021) in the interleaved-pair layout."""

from tlm_rope.rope import RotaryPositionalEmbedding

__version__ = "0.2.0"

__all__ = ["RotaryPositionalEmbedding", "__version__"]
