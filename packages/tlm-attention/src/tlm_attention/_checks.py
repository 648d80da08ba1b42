"""The argument checks tlm-attention repeats, each written once."""

import torch
from torch import Tensor


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_float_tensor(name: str, t: object) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def check_positions_shape(token_positions: object, lead_shape: torch.Size) -> None:
    # Checked before a heads axis is added, so the message quotes the caller's shapes.
    if not isinstance(token_positions, Tensor):
        raise TypeError(f"token_positions must be a torch.Tensor, got {type(token_positions).__name__}")
    try:
        fits = torch.broadcast_shapes(token_positions.shape, lead_shape) == lead_shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"token_positions of shape {tuple(token_positions.shape)} must broadcast to the input's "
            f"(..., seq) = {tuple(lead_shape)}"
        )


def check_cache_positions(token_positions: Tensor, start: int, seq: int) -> None:
    """With a KV cache the positions are ``start .. start + seq - 1``; explicit ones must agree.

    On CPU the values are compared here; on an accelerator (or inside ``torch.compile``) a
    device-side assert does it, so a forward never waits for the device.
    """
    if token_positions.is_floating_point() or token_positions.is_complex() or token_positions.dtype == torch.bool:
        raise TypeError(f"token_positions must be an integer tensor, got dtype {token_positions.dtype}")
    if token_positions.device.type == "meta":
        return
    agree = token_positions.long() == torch.arange(start, start + seq, device=token_positions.device)
    if torch.compiler.is_compiling() or token_positions.device.type != "cpu":
        # A fixed message: under torch.compile start and seq may be symbolic.
        torch._assert_async(agree.all(), "token_positions must be the KV cache's positions (its length onwards)")
    elif not bool(agree.all()):
        raise ValueError(
            f"token_positions must be the KV cache's positions {start}..{start + seq - 1} (the cache holds "
            f"{start} tokens); pass token_positions=None to take them from the cache, got {token_positions.tolist()}"
        )
