"""Continuous batching: sequences that decode together, one forward per step, joining and leaving between steps."""

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from tlm_core.checks import check_int, check_positive_int
from tlm_core.tensors import as_index_tensor
from tlm_model.inference import InferenceModel
from tlm_model.lm import TransformerLM


class DecodeBatch:
    """The rows of a decoding batch: each its own sequence, at its own length, all fed by one forward a step.

    ``add(prompt_ids)`` runs a prompt alone (its own KV cache, sized to it) and appends it as a new row of
    the batch's cache; ``step(tokens)`` feeds one new token to every row in one batched forward and
    returns each row's next-token logits; ``remove(row)`` lets a row go. A row's logits are those of its
    sequence decoded alone, up to float rounding of the batched matmuls (the cache keeps a length per row,
    see :class:`~tlm_attention.KVCache`). This is the model-side half of a server's scheduler (vLLM's and
    TGI's continuous batching): which requests join or leave, and how each one samples, is the caller's.

    Rows are numbered ``0 .. len(batch) - 1`` and stay compact: removing row ``r`` moves the last row into
    its place (``remove`` says which row moved). A sequence longer than ``capacity`` (default: the model's
    context) does not fit; the caller keeps prompt + new tokens within it. Nothing is checked per step.
    """

    def __init__(self, model: TransformerLM | InferenceModel, max_batch_size: int, capacity: int | None = None) -> None:
        if not isinstance(model, (TransformerLM, InferenceModel)):
            raise TypeError(f"model must be a TransformerLM or an InferenceModel, got {type(model).__name__}")
        check_positive_int("max_batch_size", max_batch_size)
        self.model = model
        self.capacity = model.config.context_length if capacity is None else capacity
        self.caches = model.new_kv_cache(max_batch_size, capacity=self.capacity)
        for cache in self.caches:
            cache.select_rows([])

    def __len__(self) -> int:
        return self.caches[0].batch_size

    @property
    def max_batch_size(self) -> int:
        return self.caches[0].max_batch_size

    @property
    def lengths(self) -> tuple[int, ...]:
        """Each row's tokens so far (prompt + tokens fed)."""
        return self.caches[0].lengths

    @torch.no_grad()
    def add(self, prompt_ids: Integer[Tensor, " prompt"], *, every_position: bool = False) -> Float[Tensor, "..."]:
        """Run ``prompt_ids`` alone and append it as the last row; returns its next-token logits, shape (vocab,),
        or with ``every_position`` the logits after each prompt token, shape (prompt, vocab), from the same
        forward (a server scoring the prompt: the last row is the next token's)."""
        if len(self) == self.max_batch_size:
            raise ValueError(f"the batch has room for {self.max_batch_size} rows, all in use")
        if not isinstance(prompt_ids, Tensor) or prompt_ids.ndim != 1 or not 0 < len(prompt_ids) <= self.capacity:
            raise ValueError(
                f"prompt_ids must be a tensor of shape (prompt,) with 1 to {self.capacity} ids, got "
                + (str(tuple(prompt_ids.shape)) if isinstance(prompt_ids, Tensor) else type(prompt_ids).__name__)
            )
        ids = as_index_tensor("prompt_ids", prompt_ids, self.model.config.vocab_size, "vocab_size")
        alone = self.model.new_kv_cache(1, capacity=len(ids))
        logits = self.model(ids.unsqueeze(0), kv_cache=alone)[0]
        for cache, source in zip(self.caches, alone, strict=True):
            cache.append_row(source)
        return logits if every_position else logits[-1]

    @torch.no_grad()
    def step(self, tokens: Integer[Tensor, " batch"]) -> Float[Tensor, "batch vocab"]:
        """Feed ``tokens[r]`` to row ``r``, every row in one forward; returns each row's next-token logits."""
        return self.model(tokens.unsqueeze(1), kv_cache=self.caches)[:, -1]

    def remove(self, row: int) -> int | None:
        """Drop row ``row``; the last row moves into its place. Returns the index the moved row had, or None."""
        rows = len(self)
        check_int("row", row, low=0, high=rows - 1)
        last = rows - 1
        keep = list(range(last))
        if row != last:
            keep[row] = last
        for cache in self.caches:
            cache.select_rows(keep)
        return last if row != last else None
