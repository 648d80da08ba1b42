"""Position-wise feed-forward networks: SwiGLU and the two-matrix SiLU FFN."""

from tlm_ffn.silu_ffn import SiLUFFN
from tlm_ffn.swiglu import FFN_KINDS, SwiGLU, default_d_ff, silu, silu_mul

__version__ = "0.4.0"

__all__ = ["FFN_KINDS", "SiLUFFN", "SwiGLU", "__version__", "default_d_ff", "silu", "silu_mul"]
