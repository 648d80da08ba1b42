"""RoPE inverse frequencies, plain and context-extended, computed in float64.

Each scaling rule follows its paper and the keys of HF transformers' ``rope_parameters``:
``linear`` (position interpolation, Chen et al. 2023), ``dynamic`` (dynamic NTK-aware, bloc97 /
Reddit 2023: the base grows with the sequence length), ``yarn`` (Peng et al. 2023) and ``llama3``
(Meta's Llama 3.1 code). Each returns the inverse frequencies of the ``rotary_dim / 2`` pairs and the
factor that cos and sin are multiplied by (YaRN's attention temperature; 1 for the others).
"""

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from tlm_rope.options import SCALINGS, check_scaling

__all__ = ["SCALINGS", "check_scaling", "default_inv_freq", "inv_freq_and_factor"]


def default_inv_freq(theta: float, rotary_dim: int) -> Tensor:
    """θ_k = Θ^(-2k/d) for k < d/2, in float64."""
    return theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def inv_freq_and_factor(
    theta: float, rotary_dim: int, scaling: Mapping[str, Any] | None, seq_len: int | None = None
) -> tuple[Tensor, float]:
    """Inverse frequencies (float64, shape (rotary_dim/2,)) and the cos/sin factor.

    ``seq_len`` is the length the sequence reaches; only ``dynamic`` depends on it.
    """
    inv_freq = default_inv_freq(theta, rotary_dim)
    if scaling is None:
        return inv_freq, 1.0
    kind, factor = scaling["rope_type"], float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "dynamic":
        original = scaling["original_max_position_embeddings"]
        length = original if seq_len is None else max(seq_len, original)
        base = theta * ((factor * length / original) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return default_inv_freq(base, rotary_dim), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, factor, scaling), 1.0
    return _yarn(theta, rotary_dim, inv_freq, factor, scaling)


def _llama3(inv_freq: Tensor, factor: float, scaling: Mapping[str, Any]) -> Tensor:
    # Long wavelengths (beyond the original context / low_freq_factor) are interpolated by factor,
    # short ones (below original / high_freq_factor) kept, the band between blended linearly in 1/λ.
    original = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _yarn(
    theta: float, rotary_dim: int, inv_freq: Tensor, factor: float, scaling: Mapping[str, Any]
) -> tuple[Tensor, float]:
    original = scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        # The pair index whose wavelength fits ``rotations`` times into the original context.
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    # ramp 0: fast pairs keep their frequency (extrapolate); ramp 1: slow pairs are interpolated.
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)
