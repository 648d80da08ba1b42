"""SwiGLU position-wise feed-forward network."""

from tlm_ffn.swiglu import SwiGLU, default_d_ff, silu, silu_mul

__version__ = "0.3.0"

__all__ = ["SwiGLU", "__version__", "default_d_ff", "silu", "silu_mul"]
