"""What a RoPE can be configured with: the pair layouts and the context-extension rules, with their
checks. Standard library only, so a config (``tlm_model.ModelConfig``) or a command line can name and
check them without importing torch; :mod:`tlm_rope.scaling` computes the frequencies.
"""

from collections.abc import Mapping
from typing import Any

from tlm_core.checks import check_number

#: The pairings of features: ``interleaved`` (x[2k], x[2k+1]), the course's and Meta's; ``half``
#: (x[k], x[k + d/2]), HF's and GPT-NeoX's rotate-half.
LAYOUTS = ("interleaved", "half")

#: rope_type -> (required keys, optional keys)
SCALINGS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor", "original_max_position_embeddings"}), frozenset()),
    "yarn": (
        frozenset({"factor", "original_max_position_embeddings"}),
        frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    ),
    "llama3": (
        frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
        frozenset(),
    ),
}


def check_scaling(scaling: object) -> dict[str, Any] | None:
    """A copy of ``scaling`` (None, or a mapping with ``rope_type`` and that type's keys), checked."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be a dict or None, got {type(scaling).__name__}")
    kind = scaling.get("rope_type")
    if kind not in SCALINGS:
        raise ValueError(f"scaling['rope_type'] must be one of {sorted(SCALINGS)}, got {kind!r}")
    required, optional = SCALINGS[kind]
    keys = set(scaling) - {"rope_type"}
    if missing := sorted(required - keys):
        raise ValueError(f"scaling of rope_type {kind!r} needs keys {missing}, got {sorted(scaling)}")
    if unknown := sorted(keys - required - optional):
        raise ValueError(f"scaling of rope_type {kind!r} does not take keys {unknown}")
    check_number("scaling['factor']", scaling["factor"], low=1.0)
    return dict(scaling)
