"""Mean next-token loss of a model over fixed evaluation batches."""

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from tlm_model import cross_entropy


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]]) -> float:
    """Token-weighted mean cross-entropy of ``model(inputs)`` against ``targets`` over ``batches``.

    Use with :class:`EvalBatches` for a deterministic validation loss. The model runs in eval mode
    and gets its previous mode back afterwards.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for inputs, targets in batches:
            total += cross_entropy(model(inputs), targets).item() * targets.numel()
            tokens += targets.numel()
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("batches must yield at least one batch, got none")
    return total / tokens
