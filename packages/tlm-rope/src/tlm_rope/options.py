"""What a RoPE can be configured with: the pair layouts and the context-extension rules, with their
checks. Standard library only, so a config (``tlm_model.ModelConfig``) or a command line can name and
check them without importing torch; :mod:`tlm_rope.scaling` computes the frequencies.
"""

from collections.abc import Mapping
from typing import Any

from tlm_core.checks import check_choice, check_number, check_positive_int

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


#: Other names of the rules: NTK-aware scaling is HF's ``dynamic``.
RULE_ALIASES = {"ntk": "dynamic"}
#: Every name :func:`extension_scaling` takes for a rule.
RULE_NAMES = (*SCALINGS, *RULE_ALIASES)

#: What :func:`extension_scaling` fills in for a rule's keys that the caller leaves out: Meta's Llama 3.1 band
#: (``low_freq_factor`` 1, ``high_freq_factor`` 4); YaRN's betas and temperature take the paper's defaults
#: (:mod:`tlm_rope.scaling`) when absent.
EXTENSION_DEFAULTS: dict[str, dict[str, float]] = {"llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0}}


def extension_scaling(
    rule: str | Mapping[str, Any], original: int, target: int, factor: float | None = None
) -> dict[str, Any]:
    """The scaling that extends a RoPE trained on ``original`` positions to ``target``: ``rule`` (a rope_type or
    one of :data:`RULE_ALIASES`, or a mapping with ``rope_type`` and any of its keys) with the keys it leaves
    out filled in: ``factor`` (default ``target / original``, at least 1), ``original_max_position_embeddings``
    (``original``) for the rules that take it, and :data:`EXTENSION_DEFAULTS`. Checked as
    :func:`check_scaling` checks."""
    given: dict[str, Any] = {"rope_type": rule} if isinstance(rule, str) else dict(rule)
    name = str(check_choice("rope_type", given.get("rope_type"), RULE_NAMES))
    kind = given["rope_type"] = RULE_ALIASES.get(name, name)
    check_positive_int("original", original)
    check_positive_int("target", target)
    if factor is not None and "factor" in given and given["factor"] != factor:
        raise ValueError(f"factor={factor} disagrees with the scaling's own factor {given['factor']}")
    if factor is None and "factor" not in given and target <= original:
        raise ValueError(
            f"a context extension needs target > original (the factor defaults to target / original), got target="
            f"{target}, original={original}; give the factor"
        )
    filled: dict[str, Any] = {"factor": float(factor) if factor is not None else target / original}
    required, optional = SCALINGS[kind]
    if "original_max_position_embeddings" in required:
        filled["original_max_position_embeddings"] = original
    filled.update(EXTENSION_DEFAULTS.get(kind, {}))
    scaling = {"rope_type": kind, **{k: v for k, v in filled.items() if k in required | optional}, **given}
    checked = check_scaling(scaling)
    assert checked is not None
    return checked
