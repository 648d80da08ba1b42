"""The feed-forward kinds and their default widths, without torch, so that a config (``tlm_model.ModelConfig``,
``tlm_train.TrainConfig``) or a command line names them without importing torch."""

from tlm_core.checks import check_choice, check_positive_int

#: The feed-forward kinds :func:`tlm_ffn.default_d_ff` knows: the gated SwiGLU and the two-matrix SiLU FFN.
FFN_KINDS = ("swiglu", "silu")


def default_d_ff(d_model: int, multiple_of: int = 64, *, kind: str = "swiglu") -> int:
    """The hidden width a feed-forward of ``kind`` uses when none is given (CS336 §1.5.2, §7).

    ``"swiglu"``: 8/3 · d_model rounded up to ``multiple_of``; 8/3 keeps the parameter count of a
    4·d_model two-matrix FFN with three matrices, and the rounding keeps matrix shapes friendly to
    hardware tiles. ``"silu"``: 4 · d_model, the two-matrix FFN's width (a whole number already, so
    ``multiple_of`` does not apply). Either way the FFN holds about 8 · d_model² parameters.
    """
    check_positive_int("d_model", d_model)
    check_positive_int("multiple_of", multiple_of)
    check_choice("kind", kind, FFN_KINDS)
    if kind == "silu":
        return 4 * d_model
    # Integer ceil-division avoids float rounding for large d_model.
    return multiple_of * -(-(8 * d_model) // (3 * multiple_of))


def checked_d_ff(d_model: int, d_ff: int | None, kind: str) -> int:
    """The width an FFN of ``kind`` is built with: ``d_ff``, or :func:`default_d_ff` when it is None; both
    sizes checked (what the FFN constructors share)."""
    check_positive_int("d_model", d_model)
    return default_d_ff(d_model, kind=kind) if d_ff is None else check_positive_int("d_ff", d_ff)
