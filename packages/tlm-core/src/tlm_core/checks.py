"""Argument checks with one message style: ``<name> must be <expectation>, got <what came>``.

Every tlm package checks its public arguments with these, so the same mistake reads the same way
everywhere. A ``bool`` is never accepted as a number (``True`` is an ``int`` to Python, and almost
always a slip), and values are quoted short so that a huge argument cannot make a huge message.
"""

import math
from collections.abc import Collection
from typing import TypeVar

__all__ = ["check_bool", "check_choice", "check_int", "check_number", "check_positive_int", "rephrased", "short_repr"]

T = TypeVar("T")

_REPR_LIMIT = 80


def short_repr(value: object, limit: int = _REPR_LIMIT) -> str:
    """``repr(value)`` cut to about ``limit`` characters (an error message must stay one short line)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text):,} chars)"


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]`` (either bound may be None)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({short_repr(value)})")
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            expected = "positive" if low == 1 else f">= {low}"
        elif low is None:
            expected = f"<= {high}"
        else:
            expected = f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1."""
    return check_int(name, value, low=1)


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a float if it is a finite int or float in the interval the bounds describe.

    ``low``/``high`` are inclusive unless ``low_open``/``high_open``; NaN and infinities are refused.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({short_repr(value)})")
    number = float(value)
    inside = math.isfinite(number)
    inside = inside and (low is None or (number > low if low_open else number >= low))
    inside = inside and (high is None or (number < high if high_open else number <= high))
    if not inside:
        raise ValueError(f"{name} must be a finite number{_interval(low, high, low_open, high_open)}, got {value!r}")
    return number


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" {'>' if low_open else '>='} {low:g}"
    if low is None:
        return f" {'<' if high_open else '<='} {high:g}"
    return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool (0 and 1 are refused: a flag is a flag)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({short_repr(value)})")
    return value


def check_choice(name: str, value: T, choices: Collection[T]) -> T:
    """``value`` if it is one of ``choices``."""
    try:
        found = value in choices
    except TypeError:  # an unhashable value asked of a set
        found = False
    if not found:
        raise ValueError(f"{name} must be one of {sorted(map(str, choices))}, got {short_repr(value)}")
    return value


def rephrased(err: Exception, message: str) -> Exception:
    """``err``'s own type with ``message``, to raise in its place with more context (the file, the flag). A type
    that does not take a message alone (``UnicodeEncodeError`` takes 5 arguments, ``json.JSONDecodeError`` 3) gives
    its base ValueError or TypeError: ``type(err)(message)`` raised "function takes exactly 5 arguments" instead."""
    try:
        same = type(err)(message)
    except Exception:
        same = None
    if same is not None and str(same) == message:
        return same
    return (TypeError if isinstance(err, TypeError) else ValueError)(message)
