"""The argument checks that every module here repeats, as one helper each."""

import math


def check_number(name: str, value: object, *, low: float, high: float = math.inf, high_open: bool = False) -> float:
    """``value`` as a float if it is a real number in ``[low, high]`` (``[low, high)`` if ``high_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    inside = low <= value < high if high_open else low <= value <= high
    if not inside or math.isnan(value):
        bracket = ")" if high_open else "]"
        raise ValueError(f"{name} must lie in [{low}, {high}{bracket}, got {value!r}")
    return value


def check_int(name: str, value: object, *, low: int) -> int:
    """``value`` if it is an int (not a bool) that is at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value
