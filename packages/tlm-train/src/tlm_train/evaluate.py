"""Evaluation: the mean next-token loss of a model over fixed batches, forward passes only.

One function serves the validation loss of a training run and ``tlm eval``. It runs under
``torch.no_grad()``, where the chunked loss builds no gradient buffers, and reads the device once, at
the end. With ``token_bytes`` (the UTF-8 length of each token id) it also counts the bytes of the text
the targets stand for, so a caller can report bits per byte, a measure that does not depend on the
tokenizer.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from tlm_model.loss import IGNORE_INDEX
from tlm_train.step import autocast


@dataclass(frozen=True)
class EvalResult:
    """Totals over every evaluated target token."""

    loss: float  # mean cross-entropy, nats per token
    tokens: int
    nats: float  # the summed cross-entropy
    bytes: int | None = None  # UTF-8 bytes the targets stand for, when token_bytes was given

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    @property
    def bits_per_byte(self) -> float | None:
        return None if not self.bytes else self.nats / math.log(2) / self.bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "loss": self.loss,
            "perplexity": self.perplexity,
            "bits_per_byte": self.bits_per_byte,
            "bytes": self.bytes,
        }


def token_byte_lengths(tokenizer: Any, vocab_size: int) -> Tensor:
    """The byte length of each id's text, int64 of shape (vocab_size,): special tokens and ids the tokenizer
    lacks count 0, since they stand for no text (``evaluate``'s ``token_bytes``)."""
    specials = {tokenizer.encode(s)[0] for s in tokenizer.special_tokens}
    table = tokenizer.vocab
    return torch.tensor([0 if i in specials else len(table.get(i, b"")) for i in range(vocab_size)], dtype=torch.int64)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    *,
    autocast_dtype: torch.dtype | None = None,
    token_bytes: Tensor | None = None,
) -> EvalResult:
    """Token-weighted mean loss of ``model`` over ``batches`` of (inputs, targets), in eval mode (the
    training mode is restored). ``model`` is a TransformerLM (its ``loss``) or a module whose
    ``forward(inputs, targets)`` is the loss (:class:`~tlm_train.LanguageModelLoss`, wrapped in DDP or
    FSDP2: every rank must pass the same batches, e.g. :class:`~tlm_train.EvalBatches`, and gets the same
    result). ``token_bytes[id]`` is the byte length of token ``id``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    loss_of = cast(Any, model).loss if hasattr(model, "loss") and callable(model.loss) else model
    was_training = model.training
    model.eval()
    total: Tensor | None = None
    count: Tensor | None = None
    scored: Tensor | None = None
    try:
        for inputs, targets in batches:
            kept = targets != IGNORE_INDEX  # targets the loss skips (a chat prompt's) count for nothing
            n_kept = kept.sum()
            with autocast(inputs.device, autocast_dtype):
                loss = loss_of(inputs, targets).double() * n_kept
            total = loss if total is None else total + loss
            scored = n_kept if scored is None else scored + n_kept
            if token_bytes is not None:
                n = (token_bytes.to(targets.device)[torch.where(kept, targets, 0)] * kept).sum()
                count = n if count is None else count + n
    finally:
        model.train(was_training)
    if total is None or scored is None:
        raise ValueError("batches must hold at least one (inputs, targets) pair, got none")
    nats, tokens = float(total), int(scored)  # the device round trips
    return EvalResult(loss=nats / max(tokens, 1), tokens=tokens, nats=nats, bytes=None if count is None else int(count))
