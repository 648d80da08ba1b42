"""Position-wise feed-forward networks: SwiGLU and the two-matrix SiLU FFN.

Names load on first use (PEP 562): ``from tlm_ffn.options import FFN_KINDS, default_d_ff`` costs no torch
import, which a config or a command line that only names a kind relies on.
"""

from typing import TYPE_CHECKING

from tlm_core.lazy import lazy_exports

__version__ = "0.4.0"

__all__ = ["FFN_KINDS", "SiLUFFN", "SwiGLU", "__version__", "default_d_ff", "silu", "silu_mul"]

_HOMES = {
    "FFN_KINDS": "tlm_ffn.options",
    "SiLUFFN": "tlm_ffn.silu_ffn",
    "SwiGLU": "tlm_ffn.swiglu",
    "default_d_ff": "tlm_ffn.options",
    "silu": "tlm_ffn.swiglu",
    "silu_mul": "tlm_ffn.swiglu",
}

if TYPE_CHECKING:
    from tlm_ffn.options import FFN_KINDS, default_d_ff
    from tlm_ffn.silu_ffn import SiLUFFN
    from tlm_ffn.swiglu import SwiGLU, silu, silu_mul


lazy_exports(__name__, _HOMES)
