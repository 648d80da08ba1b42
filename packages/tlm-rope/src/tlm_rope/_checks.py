"""The argument checks tlm-rope repeats, each written once."""

import math

import torch
from torch import Tensor


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} ({value!r})")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


def as_index_tensor(name: str, t: Tensor, high: int, bound_name: str) -> Tensor:
    """``t`` as int64 indices, each in [0, high); any integer dtype is accepted, never read as a mask.

    The range is checked on CPU tensors here; on an accelerator, or inside ``torch.compile``, by a
    device-side assert, so no forward waits for the device.
    """
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    # int64 for every integer dtype: indexing reads uint8 as a mask, and min/max do not exist for
    # uint16/32/64.
    idx = t if t.dtype == torch.int64 else t.long()
    if idx.numel() == 0 or idx.device.type == "meta":
        return idx
    if torch.compiler.is_compiling() or idx.device.type != "cpu":
        torch._assert_async(((idx >= 0) & (idx < high)).all(), f"{name} must lie in [0, {bound_name}={high})")
    else:
        low, top = int(idx.min()), int(idx.max())
        if low < 0 or top >= high:
            raise ValueError(f"{name} must lie in [0, {bound_name}={high}), got values in [{low}, {top}]")
    return idx
