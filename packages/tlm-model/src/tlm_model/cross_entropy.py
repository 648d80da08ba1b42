"""Cross-entropy of unnormalised logits (CS336 assignment 1, §4.1), computed stably.

ℓ = −log softmax(o)[y] = logsumexp(o) − o[y]. Subtracting the row maximum first keeps every
exponent ≤ 0 (no overflow for logits of any size), and the log of the softmax is never formed,
so log and exp cancel symbolically instead of numerically. Half-precision logits are promoted to
float32 for the computation.
"""

import torch
from jaxtyping import Float, Integer
from torch import Tensor


def cross_entropy(logits: Float[Tensor, "... vocab"], targets: Integer[Tensor, "..."]) -> Float[Tensor, ""]:
    """Mean over all leading dimensions of −log softmax(logits)[targets].

    Returns a scalar in float32 (float64 for float64 logits); bfloat16 and float16 logits are
    computed in float32, not in their own precision. Equals ``F.cross_entropy(logits.float(),
    targets)`` for 2-D input. Targets must lie in ``[0, vocab)`` (checked for CPU tensors).
    """
    if not isinstance(logits, Tensor) or not isinstance(targets, Tensor):
        raise TypeError(f"logits and targets must be Tensors, got {type(logits).__name__} and {type(targets).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got dtype {logits.dtype}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor, got dtype {targets.dtype}")
    if logits.ndim == 0 or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have the shape of logits without its last (vocab) axis, got logits "
            f"{tuple(logits.shape)} and targets {tuple(targets.shape)}"
        )
    vocab = logits.shape[-1]
    if targets.numel() == 0 or vocab == 0:
        raise ValueError(f"cross_entropy needs at least one token and one class, got logits {tuple(logits.shape)}")
    if targets.device.type == "cpu" and not torch.compiler.is_compiling():
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"targets must lie in [0, vocab={vocab}), got values in [{low}, {high}]")
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # The maximum is a constant shift: detaching it leaves the gradient exactly softmax − one_hot.
    shifted = x - x.amax(dim=-1, keepdim=True).detach()
    log_normaliser = torch.log(torch.exp(shifted).sum(dim=-1))
    picked = shifted.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return (log_normaliser - picked).mean()
