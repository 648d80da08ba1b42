"""Checks and names for tensors, shared by the packages that depend on torch (this module imports it)."""

import torch
from torch import Tensor

__all__ = ["DTYPES", "as_index_tensor", "check_float_tensor", "device_from_name", "dtype_from_name"]

#: The floating dtypes tlm accepts by name (command lines, configs, checkpoints).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def dtype_from_name(name: str, what: str = "dtype") -> torch.dtype:
    """``torch.float32`` for ``"float32"`` (and the other :data:`DTYPES`); a clear error otherwise."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"{what} must be one of {sorted(DTYPES)}, got {name!r}") from None


def check_float_tensor(name: str, t: object) -> Tensor:
    """``t`` if it is a floating-point tensor (activations, scores, Q/K/V); integer and bool tensors are refused."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def as_index_tensor(name: str, t: object, high: int, bound_name: str) -> Tensor:
    """``t`` as int64 indices, each in ``[0, high)``; any integer dtype is accepted, never read as a mask.

    int64 for every integer dtype: indexing reads uint8 as a mask, and min/max do not exist for the
    unsigned types np.memmap of a token file gives. This is a boundary check (a prompt entering
    ``generate``): the range is read back to the host, one read on an accelerator. Inside
    ``torch.compile`` it is not checked at all (an out-of-range id is then the embedding's kernel's
    error); never a device-side assert, which on CUDA would poison the context instead of raising.
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    ids = t if t.dtype == torch.int64 else t.long()
    if ids.numel() == 0 or ids.device.type == "meta":
        return ids
    if torch.compiler.is_compiling():
        return ids
    low, top = torch.stack(torch.aminmax(ids)).tolist()  # one read of both, at the boundary
    if low < 0 or top >= high:
        raise ValueError(f"{name} must lie in [0, {bound_name}={high}), got values in [{low}, {top}]")
    return ids


def device_from_name(name: str, what: str = "--device") -> torch.device:
    """The torch device ``name`` if this process can use it; a one-line ``ValueError`` naming ``what`` if not
    (no such device type, no CUDA in this torch build, an index past the devices there are)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what} must be a torch device such as cpu, cuda or cuda:1, got {name!r}") from None
    if device.type not in ("cpu", "cuda", "mps", "xpu", "meta"):
        raise ValueError(f"{what} {name}: tlm runs on cpu, cuda, mps or xpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} {name}: this torch has no CUDA device (torch.cuda.is_available() is False)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{what} {name}: only {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{what} {name}: MPS is not available")
    if device.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise ValueError(f"{what} {name}: XPU is not available")
    return device
