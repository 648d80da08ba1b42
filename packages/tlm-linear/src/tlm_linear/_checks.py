"""The argument checks tlm-linear repeats, each written once."""

import torch
from torch import Tensor


def check_dim(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def as_index_tensor(name: str, t: object, high: int, bound_name: str) -> Tensor:
    """``t`` as int64 ids, each in [0, high); any integer dtype is accepted, never read as a mask.

    The range is checked on CPU tensors here; on an accelerator, or inside ``torch.compile``, by a
    device-side assert, so no forward waits for the device.
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    # int64 for every integer dtype: indexing reads uint8 as a mask, and min/max do not exist for
    # uint16/32/64 (what np.memmap of a token file gives).
    ids = t if t.dtype == torch.int64 else t.long()
    if ids.numel() == 0 or ids.device.type == "meta":
        return ids
    if torch.compiler.is_compiling() or ids.device.type != "cpu":
        torch._assert_async(((ids >= 0) & (ids < high)).all(), f"{name} must lie in [0, {bound_name}={high})")
    else:
        low, top = int(ids.min()), int(ids.max())
        if low < 0 or top >= high:
            raise ValueError(f"{name} must lie in [0, {bound_name}={high}), got values in [{low}, {top}]")
    return ids
