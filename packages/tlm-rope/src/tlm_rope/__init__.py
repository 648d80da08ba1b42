"""Rotary positional embedding (RoPE, Su et al. 2021): interleaved or rotate-half pairs, partial
rotary, and context-extension scaling (linear, dynamic NTK, YaRN, Llama 3)."""

from tlm_rope.rope import LAYOUTS, RotaryPositionalEmbedding
from tlm_rope.scaling import SCALINGS, inv_freq_and_factor

__version__ = "0.3.0"

__all__ = ["LAYOUTS", "SCALINGS", "RotaryPositionalEmbedding", "__version__", "inv_freq_and_factor"]
