"""A model's key/value cache for incremental decoding: buffers allocated once, one length per row kept once."""

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from tlm_core.checks import check_int, check_positive_int


class KVCache:
    """Keys and values of the tokens seen so far for every attention layer of a model (``layers``), and how many
    tokens each row holds, kept once for all layers.

    Each layer's buffers (:attr:`key_buffers`, :attr:`value_buffers`), of shape (batch, heads, capacity + 1,
    d_head) (``num_heads``: the attention's key/value heads), are allocated once (gpt-fast's ``setup_caches``) and
    never move (a CUDA graph may hold them); slot ``capacity`` is a scratch slot that only padding writes.
    Row ``b`` stores its tokens in slots ``0 .. lengths[b] - 1`` (a token's slot is its position), its length kept
    on the host (:attr:`lengths`: reading it never waits for the device) and on the device
    (:attr:`device_lengths`, where positions come from). Between steps rows join (:meth:`append_empty_row`),
    leave (:meth:`select_rows`), are cut back (:meth:`truncate`), copied from another cache (:meth:`copy_from`)
    or take a prefix another buffer row holds (:meth:`copy_rows`: a prefix cache); a new cache has
    ``batch_size`` empty rows.

    A step :meth:`write` s each layer's new keys and values with one indexed copy and changes no host state;
    :meth:`advance` then records the new lengths once: a step that failed half-way (an error, Ctrl-C) leaves every
    length as it was, and the slots it wrote past them count for nothing (all-or-nothing without a rollback).
    """

    def __init__(
        self,
        batch_size: int,
        num_heads: int,
        capacity: int,
        d_head: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        layers: int = 1,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("num_heads", num_heads),
            ("capacity", capacity),
            ("d_head", d_head),
            ("layers", layers),
        ):
            check_positive_int(name, value)
        shape = (batch_size, num_heads, capacity + 1, d_head)  # one slot more: the scratch slot
        self.key_buffers = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.value_buffers = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        #: Each buffer row's length on the device (a row not in use: the capacity).
        self.device_lengths = torch.zeros(batch_size, dtype=torch.int64, device=self.key_buffers[0].device)
        self.capacity = capacity
        self.max_batch_size = batch_size
        self._lengths = [0] * batch_size

    @property
    def batch_size(self) -> int:
        """The rows in use."""
        return len(self._lengths)

    @property
    def layers(self) -> int:
        return len(self.key_buffers)

    @property
    def dtype(self) -> torch.dtype:
        return self.key_buffers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.key_buffers[0].device

    @property
    def lengths(self) -> tuple[int, ...]:
        """How many tokens each row in use holds (host-side ints)."""
        return tuple(self._lengths)

    def continuation(self, new: int) -> tuple[Tensor, Tensor]:
        """Each row in use continued by ``new`` tokens: their (batch, new) positions, each row's length onwards
        (from :attr:`device_lengths`: nothing crosses from the host), and ``arange(n)`` on the device, the
        slots up to the longest row's new length (the occupied prefix a step reads). A ValueError when a row
        would pass the capacity (host-side lengths: no device read)."""
        check_positive_int("new", new)
        longest = max([0, *self._lengths])  # (dynamo traces this, and knows no max(default=))
        if longest + new > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} tokens; {longest} stored + {new} new is too many")
        steps = torch.arange(longest + new, device=self.device)
        return self.device_lengths[: self.batch_size].unsqueeze(1) + steps[:new], steps

    def write(
        self,
        layer: int,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        rows: Tensor | None = None,
        limit: "int | torch.SymInt | None" = None,
    ) -> tuple[Tensor, Tensor]:
        """Store layer ``layer``'s (batch, heads, new, d_head) ``keys`` and ``values`` at slots ``positions``
        (batch, new) of buffer rows ``rows`` (batch,) (default the first ``batch`` rows) with one indexed copy per
        buffer (gpt-fast's ``index_copy_``: compiled, it writes the new entries only); return those rows' whole
        buffers (batch, heads, capacity + 1, d_head), or their first ``limit`` slots. Unchecked (a compiled step's
        hot path): positions lie in ``[0, capacity]`` (the scratch slot), and :meth:`advance` follows."""
        key_buffer, value_buffer = self.key_buffers[layer], self.value_buffers[layer]
        batch = keys.shape[0]
        index = torch.arange(batch, device=keys.device) if rows is None else rows
        # Advanced indices around a slice put their axes first: (batch, new, heads, d_head).
        # In the buffers' dtype (a no-op unless autocast computed the keys in another).
        key_buffer[index[:, None], :, positions] = keys.transpose(1, 2).to(key_buffer.dtype)
        value_buffer[index[:, None], :, positions] = values.transpose(1, 2).to(value_buffer.dtype)
        if rows is None:
            return key_buffer[:batch, :, :limit], value_buffer[:batch, :, :limit]
        return key_buffer[rows, :, :limit], value_buffer[rows, :, :limit]

    def advance(self, new: Sequence[int], device_new: Tensor | None = None) -> None:
        """Row ``r`` of the rows in use now holds ``new[r]`` more tokens (after :meth:`write`); ``device_new``,
        the same counts as an int64 tensor on the cache's device, saves building it from the host."""
        if len(new) != self.batch_size:
            raise ValueError(f"new must hold one int per row ({self.batch_size}), got {len(new)}")
        lengths = [have + n for have, n in zip(self._lengths, new, strict=True)]
        if any(n < 0 for n in new) or max([0, *lengths]) > self.capacity:
            raise ValueError(
                f"the KV cache holds {self.capacity} tokens per row; {self.lengths} + {list(new)} does not fit"
            )
        if device_new is None:
            device_new = torch.tensor(list(new), dtype=torch.int64, device=self.device)
        self.device_lengths[: self.batch_size] += device_new
        self._lengths = lengths

    def truncate(self, lengths: Sequence[int]) -> None:
        """Forget every token of row ``r`` from position ``lengths[r]`` on (0 <= each <= the row's length)."""
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
            raise TypeError(f"lengths must be a sequence of ints, one per row, got {type(lengths).__name__}")
        if len(lengths) != self.batch_size:
            raise ValueError(f"lengths must hold one int per row ({self.batch_size}), got {len(lengths)}")
        self._set_lengths(
            [check_int("lengths", n, low=0, high=have) for n, have in zip(lengths, self._lengths, strict=True)]
        )

    def reset(self) -> None:
        """Every row in use empty again."""
        self._set_lengths([0] * self.batch_size)

    def select_rows(self, rows: Sequence[int], *, keep_rest: bool = False) -> None:
        """Keep only ``rows`` (indices of the rows in use), in this order; the others are forgotten, or with
        ``keep_rest`` moved, in their order, to the buffer rows just past the ones kept (not in use, their
        slots intact: a prefix cache reads them later, :meth:`copy_rows`).

        Only rows that change place are copied (a swap-remove ``[0, .., n-1 .. ]`` copies one row, two with
        ``keep_rest``), and only the slots that hold their tokens (no slot past the longest moved row's length
        counts)."""
        for row in rows:
            check_int("rows", row, low=0, high=self.batch_size - 1)
        if len(set(rows)) != len(rows):
            raise ValueError(f"rows must not repeat a row, got {list(rows)}")
        order = [*rows, *(r for r in range(self.batch_size) if r not in set(rows))] if keep_rest else rows
        moved = [(dst, src) for dst, src in enumerate(order) if dst != src]
        if moved:
            dst, src = zip(*moved, strict=True)
            self.copy_rows(dst, src, max(self._lengths[s] for s in src))
        self._set_lengths([self._lengths[row] for row in rows])

    def copy_rows(self, dst: Sequence[int], src: Sequence[int], slots: int) -> None:
        """Slots ``0 .. slots - 1`` of buffer rows ``src`` copied into buffer rows ``dst``, rows in use or not, in
        every layer; every source is read before any row is written (``[a, b], [b, a]`` swaps two rows). No
        length changes: the caller knows what the copied slots hold."""
        if slots and len(dst):
            to, of = (torch.tensor(list(rows), dtype=torch.int64, device=self.device) for rows in (dst, src))
            for buffer in (*self.key_buffers, *self.value_buffers):
                held = buffer[:, :, :slots]
                held.index_copy_(0, to, held.index_select(0, of))  # the sources gathered first

    def append_empty_row(self, count: int = 1, *, held: int = 0) -> int:
        """Add ``count`` rows as the new last rows, each holding the ``held`` tokens its buffer row's first slots
        already hold (0: empty; more: a prefix :meth:`copy_rows` put there); returns the first one's index."""
        check_positive_int("count", count)
        check_int("held", held, low=0, high=self.capacity)
        if self.batch_size == self.max_batch_size:
            raise ValueError(f"the KV cache has room for {self.max_batch_size} rows, all in use")
        if self.batch_size + count > self.max_batch_size:
            raise ValueError(
                f"the KV cache has room for {self.max_batch_size} rows; {self.batch_size} in use + {count} new is "
                "too many"
            )
        self._set_lengths([*self._lengths, *[held] * count])
        return self.batch_size - count

    def copy_from(self, source: "KVCache") -> None:
        """Hold exactly what ``source`` holds (its rows in use, their tokens and lengths); both caches must have
        the same shape (an engine taking over another's rows keeps its own buffers, whose addresses a
        compiled step may depend on)."""
        shape, theirs = (self.layers, *self.key_buffers[0].shape), (source.layers, *source.key_buffers[0].shape)
        if shape != theirs:
            raise ValueError(f"source must have this cache's (layers, *buffer shape) {shape}, got {theirs}")
        theirs_buffers = (*source.key_buffers, *source.value_buffers)
        for mine, other in zip((*self.key_buffers, *self.value_buffers), theirs_buffers, strict=True):
            mine.copy_(other)
        self._set_lengths(list(source.lengths))

    def _set_lengths(self, lengths: list[int]) -> None:
        # Rows join, leave and are cut back between steps, not during them: one host-to-device copy. A row not in
        # use is at the capacity: a padding token a step feeds it goes to the scratch slot, not over its slots.
        rest = [self.capacity] * (self.max_batch_size - len(lengths))
        self.device_lengths.copy_(torch.tensor([*lengths, *rest], dtype=torch.int64))
        self._lengths = lengths


class CacheStep(NamedTuple):
    """What one layer's attention needs for a step over a :class:`KVCache`: the cache and the ``layer`` it is,
    each new token's slot ``positions`` (batch, new) (``capacity`` for padding), the buffer ``rows`` (batch,)
    the step's rows are (None: the first ``batch``), and ``mask`` from :func:`cache_mask`, shared by all
    layers."""

    cache: KVCache
    layer: int
    positions: Tensor
    rows: Tensor | None
    mask: Tensor
    #: Read only the first ``limit`` slots (no real token of the step sits past them: the occupied prefix,
    #: rounded up to a bucket); None reads every slot. ``mask`` has as many slots. A compiled step passes a
    #: symbolic size here (the length of a ``slots`` tensor marked dynamic), so one graph serves every limit.
    limit: "int | torch.SymInt | None" = None


def cache_mask(positions: Tensor, capacity: int, slots: Tensor | None = None) -> Tensor:
    """(batch, 1, new, capacity + 1) boolean: the token at ``positions[b, t]`` may read slots ``0 ..
    positions[b, t]`` (causal, and blind to the slots past its row's length and to the scratch slot unless
    it is a padding token at ``capacity`` itself). Built once per step, on the device.

    ``slots`` (``arange(n)`` on the positions' device): the mask covers only the first ``n`` slots, shape
    (batch, 1, new, n), for a step that reads only those (:attr:`CacheStep.limit`)."""
    if slots is None:
        slots = torch.arange(capacity + 1, device=positions.device)
    return (slots <= positions.unsqueeze(-1)).unsqueeze(1)
