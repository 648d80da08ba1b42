import json
import math

import pytest

from tlm_core.checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_positive_int,
    rephrased,
    short_repr,
)


@pytest.mark.parametrize("value", [0, 5, -3, 2**70])
def test_check_int_returns_ints_in_range(value):
    assert check_int("n", value) == value


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None, [1]])
def test_check_int_refuses_non_ints_and_bools(value):
    with pytest.raises(TypeError, match=r"^n must be an int, got "):
        check_int("n", value)


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({"low": 1}, 0, "n must be positive, got 0"),
        ({"low": 0}, -1, "n must be >= 0, got -1"),
        ({"high": 3}, 4, "n must be <= 3, got 4"),
        ({"low": 1, "high": 3}, 9, r"n must be in \[1, 3\], got 9"),
    ],
)
def test_check_int_names_the_bound(kwargs, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        check_int("n", value, **kwargs)


def test_check_int_bounds_are_inclusive():
    assert check_int("n", 1, low=1, high=1) == 1
    assert check_positive_int("n", 1) == 1
    with pytest.raises(ValueError, match="positive"):
        check_positive_int("n", 0)


def test_check_number_accepts_ints_and_floats_and_returns_float():
    assert check_number("x", 3) == 3.0 and isinstance(check_number("x", 3), float)
    assert check_number("x", 0.5, low=0, high=1) == 0.5


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_check_number_refuses_non_finite(value):
    with pytest.raises(ValueError, match="must be a finite number"):
        check_number("x", value)


@pytest.mark.parametrize(
    ("kwargs", "value", "interval"),
    [
        ({"low": 0, "low_open": True}, 0.0, "> 0"),
        ({"low": 0}, -0.1, ">= 0"),
        ({"high": 1, "high_open": True}, 1.0, "< 1"),
        ({"low": 0, "high": 1, "low_open": True}, 0, r"in \(0, 1\]"),
        ({"low": 0, "high": 1, "high_open": True}, 1, r"in \[0, 1\)"),
    ],
)
def test_check_number_open_and_closed_bounds(kwargs, value, interval):
    with pytest.raises(ValueError, match=f"^x must be a finite number {interval}, got "):
        check_number("x", value, **kwargs)


@pytest.mark.parametrize("value", [True, "0.1", None, 1j])
def test_check_number_refuses_non_numbers(value):
    with pytest.raises(TypeError, match="^x must be a number, got "):
        check_number("x", value)


def test_check_bool_refuses_zero_and_one():
    assert check_bool("flag", True) is True
    for value in (0, 1, "true", None):
        with pytest.raises(TypeError, match="flag must be a bool"):
            check_bool("flag", value)


def test_check_choice():
    assert check_choice("mode", "ddp", ("none", "ddp")) == "ddp"
    with pytest.raises(ValueError, match=r"mode must be one of \['ddp', 'none'\], got 'fsdp'"):
        check_choice("mode", "fsdp", ("none", "ddp"))
    with pytest.raises(ValueError, match="must be one of"):
        check_choice("mode", ["unhashable"], {"none"})


def test_messages_stay_short_for_huge_values():
    huge = "x" * 10_000_000
    with pytest.raises(TypeError) as info:
        check_int("n", huge)
    assert len(str(info.value)) < 150
    assert short_repr("abc") == "'abc'"
    assert "10,000,002 chars" in short_repr(huge)


def _raised(error: Exception) -> Exception:
    try:
        raise error
    except Exception as err:
        return err


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ValueError("x"), ValueError),
        (TypeError("x"), TypeError),
        (FileNotFoundError("x"), FileNotFoundError),
        # Types that do not take a message alone: their base, never "function takes exactly 5 arguments".
        (_raised(UnicodeEncodeError("utf-8", "a\udcff", 1, 2, "surrogates not allowed")), ValueError),
        (_raised(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")), ValueError),
        (_raised(json.JSONDecodeError("Expecting value", "x", 0)), ValueError),
    ],
)
def test_rephrased_keeps_the_type_where_it_takes_a_message_else_its_base(error, kind):
    again = rephrased(error, "--flag: what went wrong")
    assert type(again) is kind and str(again) == "--flag: what went wrong"
