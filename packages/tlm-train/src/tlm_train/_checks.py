"""Argument checks shared by the modules of tlm_train."""


def check_int(name: str, value: object, *, low: int) -> int:
    """``value`` if it is an int (not a bool) that is at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value
