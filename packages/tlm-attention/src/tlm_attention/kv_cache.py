"""Per-layer key/value cache for incremental decoding."""

import torch
from torch import Tensor

from tlm_core.checks import check_int, check_positive_int


class KVCache:
    """Keys and values of the tokens seen so far, for one attention layer.

    Buffers of shape (batch, heads, capacity, d_head) are allocated once (``num_heads`` is the
    attention's key/value head count, ``num_kv_heads`` under grouped-query attention); ``update`` writes the
    new tokens' keys and values after the ``length`` already stored and returns views of
    everything stored, so a prefix is never recomputed. ``length`` is also the position of the
    next token, which is where RoPE continues: positions come from the cache.

    Slots past ``length`` hold nothing that counts, so :meth:`truncate` back to an earlier
    length undoes an ``update`` exactly; a model uses it to make a decoding step all-or-nothing
    across its layers.
    """

    def __init__(
        self,
        batch_size: int,
        num_heads: int,
        capacity: int,
        d_head: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("num_heads", num_heads),
            ("capacity", capacity),
            ("d_head", d_head),
        ):
            check_positive_int(name, value)
        shape = (batch_size, num_heads, capacity, d_head)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.length = 0

    def update(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Append (batch, heads, new, d_head) keys and values; return all stored so far."""
        if keys.shape != values.shape or keys.shape[:2] + keys.shape[3:] != self.keys.shape[:2] + self.keys.shape[3:]:
            raise ValueError(
                f"keys and values must have shape (batch, heads, new, d_head) = "
                f"({self.keys.shape[0]}, {self.keys.shape[1]}, new, {self.keys.shape[3]}), "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        start, end = self.length, self.length + keys.shape[2]
        if end > self.capacity:
            raise ValueError(
                f"the KV cache holds {self.capacity} tokens; {start} stored + {keys.shape[2]} new is too many"
            )
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def truncate(self, length: int) -> None:
        """Forget every token from position ``length`` on (0 <= length <= the current length)."""
        check_int("length", length, low=0, high=self.length)
        self.length = length

    def reset(self) -> None:
        self.length = 0
