"""How an attention's heads are laid out, checked without torch: a config (``tlm_model.ModelConfig``) or a
command line that only states sizes relies on that."""

from tlm_core.checks import check_positive_int


def head_layout(
    d_model: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None, *, owner: str = ""
) -> tuple[int, int]:
    """(key/value heads, per-head width) of an attention built with these arguments, after checking them:
    positive ints, ``num_kv_heads`` (default ``num_heads``) dividing ``num_heads``, and ``head_dim``
    (default ``d_model / num_heads``, which must then be whole). ``owner`` prefixes each name in the
    messages (``ModelConfig.``, whose fields these are)."""
    check_positive_int(f"{owner}d_model", d_model)
    check_positive_int(f"{owner}num_heads", num_heads)
    kv_heads = num_heads if num_kv_heads is None else check_positive_int(f"{owner}num_kv_heads", num_kv_heads)
    if num_heads % kv_heads != 0:
        raise ValueError(
            f"{owner}num_kv_heads must divide num_heads, got num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    if head_dim is not None:
        return kv_heads, check_positive_int(f"{owner}head_dim", head_dim)
    if d_model % num_heads != 0:
        raise ValueError(
            f"{owner}d_model must be divisible by num_heads, got d_model={d_model}, num_heads={num_heads} "
            "(or set head_dim)"
        )
    return kv_heads, d_model // num_heads
