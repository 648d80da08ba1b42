"""Rotary positional embedding (RoPE, Su et al. 2021): interleaved or rotate-half pairs, partial
rotary, and context-extension scaling (linear, dynamic NTK, YaRN, Llama 3).

Names load on first use (PEP 562): ``from tlm_rope.options import LAYOUTS`` (the layouts and scaling
rules, with their checks) costs no torch import, which a config or a command line that only names a
layout relies on.
"""

from typing import TYPE_CHECKING

from tlm_core.lazy import lazy_exports

__version__ = "0.4.0"

__all__ = [
    "LAYOUTS",
    "SCALINGS",
    "RotaryPositionalEmbedding",
    "__version__",
    "check_scaling",
    "extension_scaling",
    "inv_freq_and_factor",
]

_HOMES = {
    "LAYOUTS": "tlm_rope.options",
    "SCALINGS": "tlm_rope.options",
    "check_scaling": "tlm_rope.options",
    "extension_scaling": "tlm_rope.options",
    "RotaryPositionalEmbedding": "tlm_rope.rope",
    "inv_freq_and_factor": "tlm_rope.scaling",
}

if TYPE_CHECKING:
    from tlm_rope.options import LAYOUTS, SCALINGS, check_scaling, extension_scaling
    from tlm_rope.rope import RotaryPositionalEmbedding
    from tlm_rope.scaling import inv_freq_and_factor


lazy_exports(__name__, _HOMES)
