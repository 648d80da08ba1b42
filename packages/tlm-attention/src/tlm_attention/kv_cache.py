"""Per-layer key/value cache for incremental decoding, with a length per row."""

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from tlm_core.checks import check_int, check_positive_int


class KVCache:
    """Keys and values of the tokens seen so far, for one attention layer.

    Buffers of shape (batch, heads, capacity, d_head) are allocated once (``num_heads`` is the
    attention's key/value head count, ``num_kv_heads`` under grouped-query attention); ``update`` writes the
    new tokens' keys and values after those already stored and returns views of everything stored, so a
    prefix is never recomputed.

    **Rows.** Each row keeps its own length (:attr:`lengths`, host-side ints: the host always knows how
    many tokens it fed, so reading them never waits for the device). Row ``b`` stores its tokens in slots
    ``0 .. lengths[b] - 1``, and a token's slot is its position, which is where RoPE continues. While every
    row has the same length, :attr:`length` is that length and ``update(keys, values)`` appends to all rows
    alike. Rows of different lengths (a batch of prompts of different lengths, or requests that joined at
    different times) take ``update(keys, values, positions)`` with ``positions`` from :meth:`positions`:
    each row's tokens are written at its own slots, and :attr:`length` is the longest row's, the number of
    slots a step reads (a shorter row masks the slots past its own length).

    The rows in use can change between steps: :meth:`select_rows` keeps some rows (a finished request
    leaves), :meth:`append_row` adds a row copied from another cache (a request joins after its prompt was
    run alone), :meth:`set_row` replaces one. The buffers hold ``batch_size`` rows at most, the number
    given at construction; a new cache has all of them, each empty.

    Slots past a row's length hold nothing that counts, so :meth:`truncate` back to an earlier length
    undoes an ``update`` exactly; a model uses it to make a decoding step all-or-nothing across its layers.

    **Static use** (a compiled decode step of one shape, CUDA graphs). :meth:`write` stores the new
    tokens at the slots their positions name with one indexed copy into the buffers (inductor writes
    the new entries only, in place) and returns the rows' *whole* buffers, ``capacity + 1`` slots each:
    the step's shape never depends on how much is stored, and the caller masks each query to the slots
    up to its position (:func:`cache_mask`, once per step for every layer). Slot ``capacity`` is a
    scratch slot that no real token reads: padding tokens and rows that take no token write there.
    :meth:`write` changes no host state; :meth:`advance` then records the new lengths, so a step that
    failed half-way leaves every length as it was. Each row's length is also held on the device
    (:attr:`device_lengths`, int64, one entry per buffer row), so positions never come from the host.
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
        # One slot more than the capacity: the scratch slot (see "Static use").
        shape = (batch_size, num_heads, capacity + 1, d_head)
        self._key_buffer = torch.zeros(shape, device=device, dtype=dtype)
        self._value_buffer = torch.zeros(shape, device=device, dtype=dtype)
        #: Each buffer row's length on the device (a row not in use keeps a stale value <= capacity).
        self.device_lengths = torch.zeros(batch_size, dtype=torch.int64, device=self._key_buffer.device)
        self.capacity = capacity
        self._use_rows(batch_size)  # keys/values: the rows in use, views of the buffers without the scratch slot
        self.max_batch_size = batch_size
        #: The longest row's length: every row's while the rows agree (the slots a step reads).
        self.length = 0
        # None while every row holds `length` tokens; else each row's own length.
        self._row_lengths: list[int] | None = None

    @property
    def batch_size(self) -> int:
        """The rows in use."""
        return self.keys.shape[0]

    @property
    def lengths(self) -> tuple[int, ...]:
        """How many tokens each row holds (host-side ints)."""
        return (self.length,) * self.batch_size if self._row_lengths is None else tuple(self._row_lengths)

    @property
    def ragged(self) -> bool:
        """True when the rows hold different numbers of tokens (``update`` then needs ``positions``)."""
        return self._row_lengths is not None

    def positions(self, new: int) -> Tensor:
        """(batch, new) int64 positions of the next ``new`` tokens of each row: its length onwards (from
        :attr:`device_lengths`: nothing crosses from the host)."""
        steps = torch.arange(new, device=self.keys.device)
        return self.device_lengths[: self.batch_size].unsqueeze(1) + steps

    @property
    def key_buffer(self) -> Tensor:
        """Every buffer row, ``capacity + 1`` slots each (the last is the scratch slot)."""
        return self._key_buffer

    @property
    def value_buffer(self) -> Tensor:
        return self._value_buffer

    def write(
        self, keys: Tensor, values: Tensor, positions: Tensor, rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Store (batch, heads, new, d_head) ``keys`` and ``values`` at slots ``positions`` (batch, new) of
        buffer rows ``rows`` (batch,) (default the first ``batch`` rows); return those rows' whole buffers
        (batch, heads, capacity + 1, d_head). A position of ``capacity`` writes the scratch slot.

        One indexed copy per buffer (``index_put_``, as gpt-fast's ``index_copy_``): compiled, it writes the
        new entries only. Nothing is checked and no host state changes (a compiled step's hot path): the
        caller keeps positions within ``[0, capacity]`` and records the new lengths with :meth:`advance`.
        """
        batch = keys.shape[0]
        index = torch.arange(batch, device=keys.device) if rows is None else rows
        # Advanced indices around a slice put their axes first: (batch, new, heads, d_head).
        # In the buffers' dtype (a no-op unless autocast computed the keys in another).
        self._key_buffer[index[:, None], :, positions] = keys.transpose(1, 2).to(self._key_buffer.dtype)
        self._value_buffer[index[:, None], :, positions] = values.transpose(1, 2).to(self._value_buffer.dtype)
        if rows is None:
            return self._key_buffer[:batch], self._value_buffer[:batch]
        return self._key_buffer[rows], self._value_buffer[rows]

    def advance(self, new: Sequence[int], device_new: Tensor | None = None) -> None:
        """Row ``r`` of the rows in use now holds ``new[r]`` more tokens (after :meth:`write`); ``device_new``,
        the same counts as an int64 tensor on the cache's device, saves building it from the host."""
        current = self.lengths
        if len(new) != len(current):
            raise ValueError(f"new must hold one int per row ({len(current)}), got {len(new)}")
        lengths = [have + n for have, n in zip(current, new, strict=True)]
        if any(n < 0 for n in new) or max(lengths, default=0) > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} tokens per row; {current} + {list(new)} does not fit")
        if device_new is None:
            device_new = torch.tensor(list(new), dtype=torch.int64, device=self.device_lengths.device)
        self.device_lengths[: len(current)] += device_new
        self.length = max(lengths, default=0)
        self._row_lengths = None if len(set(lengths)) <= 1 else lengths

    def update(self, keys: Tensor, values: Tensor, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Append (batch, heads, new, d_head) keys and values; return all stored so far.

        Without ``positions`` every row must hold the same number of tokens. With them (``positions(new)``:
        each row's length onwards) each row's new tokens are written at their positions; the views returned
        are then :attr:`length` slots long for every row, and a shorter row must mask the slots past its own
        ``positions`` (``slot <= position``).
        """
        if keys.shape != values.shape or keys.shape[:2] + keys.shape[3:] != self.keys.shape[:2] + self.keys.shape[3:]:
            raise ValueError(
                f"keys and values must have shape (batch, heads, new, d_head) = "
                f"({self.keys.shape[0]}, {self.keys.shape[1]}, new, {self.keys.shape[3]}), "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        new = keys.shape[2]
        start, end = self.length, self.length + new
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} tokens; {start} stored + {new} new is too many")
        if positions is None:
            if self._row_lengths is not None:
                raise ValueError(
                    f"the rows of this KV cache hold different numbers of tokens {self.lengths}: update needs "
                    "positions (KVCache.positions(new))"
                )
            self.keys[:, :, start:end] = keys
            self.values[:, :, start:end] = values
        else:
            # Row b's token t goes to slot positions[b, t]: one indexed copy (written in place when compiled).
            self.write(keys, values, positions.to(torch.int64))
            if self._row_lengths is not None:
                self._row_lengths = [n + new for n in self._row_lengths]
        self.device_lengths[: self.batch_size] += new
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def truncate(self, length: int | Sequence[int]) -> None:
        """Forget every token from position ``length`` on: one int for every row, or one per row
        (0 <= each <= that row's current length)."""
        if isinstance(length, Sequence) and not isinstance(length, str):
            current = self.lengths
            if len(length) != len(current):
                raise ValueError(f"length must hold one int per row ({len(current)}), got {len(length)}")
            lengths = [check_int("length", n, low=0, high=have) for n, have in zip(length, current, strict=True)]
            self._set_lengths(lengths)
            return
        check_int("length", length, low=0, high=min(self.lengths, default=0))
        self._set_lengths([length] * self.batch_size)
        self.length = length

    def reset(self) -> None:
        """Every row in use empty again."""
        self._set_lengths([0] * self.batch_size)

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices of the rows in use), in this order; the others are forgotten.

        Only rows that change place are copied (a swap-remove ``[0, .., n-1 .. ]`` copies one row)."""
        current = self.lengths
        for row in rows:
            check_int("rows", row, low=0, high=len(current) - 1)
        if len(set(rows)) != len(rows):
            raise ValueError(f"rows must not repeat a row, got {list(rows)}")
        moved = [(dst, src) for dst, src in enumerate(rows) if dst != src]
        if moved:
            dst, src = (list(t) for t in zip(*moved, strict=True))
            # Advanced indexing gathers the sources before writing, so any order is safe.
            self._key_buffer[dst] = self._key_buffer[src]
            self._value_buffer[dst] = self._value_buffer[src]
        self._use_rows(len(rows))
        self._set_lengths([current[row] for row in rows])

    def append_row(self, source: "KVCache", row: int = 0) -> int:
        """Add a copy of ``source``'s row ``row`` as a new last row; returns its index."""
        self.append_empty_row()
        self.set_row(self.batch_size - 1, source, row)
        return self.batch_size - 1

    def append_empty_row(self, count: int = 1) -> int:
        """Add ``count`` empty rows (length 0) as the new last rows; returns the first one's index."""
        check_positive_int("count", count)
        if self.batch_size == self.max_batch_size:
            raise ValueError(f"the KV cache has room for {self.max_batch_size} rows, all in use")
        if self.batch_size + count > self.max_batch_size:
            raise ValueError(
                f"the KV cache has room for {self.max_batch_size} rows; {self.batch_size} in use + {count} new is "
                "too many"
            )
        lengths = self.lengths
        self._use_rows(self.batch_size + count)
        self._set_lengths([*lengths, *[0] * count])
        return self.batch_size - count

    def set_row(self, row: int, source: "KVCache", source_row: int = 0) -> None:
        """Replace row ``row`` by a copy of ``source``'s row ``source_row`` (its tokens and length)."""
        check_int("row", row, low=0, high=self.batch_size - 1)
        check_int("source_row", source_row, low=0, high=source.batch_size - 1)
        if source.keys.shape[1:2] + source.keys.shape[3:] != self.keys.shape[1:2] + self.keys.shape[3:]:
            raise ValueError(
                f"source must have this cache's (heads, d_head) = ({self.keys.shape[1]}, {self.keys.shape[3]}), "
                f"got ({source.keys.shape[1]}, {source.keys.shape[3]})"
            )
        n = source.lengths[source_row]
        if n > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} tokens per row; the source row holds {n}")
        self.keys[row, :, :n] = source.keys[source_row, :, :n]
        self.values[row, :, :n] = source.values[source_row, :, :n]
        lengths = list(self.lengths)
        lengths[row] = n
        self._set_lengths(lengths)

    def copy_from(self, source: "KVCache") -> None:
        """Hold exactly what ``source`` holds (its rows in use, their tokens and lengths); both caches must have
        the same shape (an engine taking over another's rows keeps its own buffers, whose addresses a
        compiled step may depend on)."""
        if source.key_buffer.shape != self._key_buffer.shape:
            raise ValueError(
                f"source must have this cache's shape {tuple(self._key_buffer.shape)}, got "
                f"{tuple(source.key_buffer.shape)}"
            )
        self._key_buffer.copy_(source.key_buffer)
        self._value_buffer.copy_(source.value_buffer)
        self._use_rows(source.batch_size)
        self._set_lengths(list(source.lengths))

    def _use_rows(self, rows: int) -> None:
        self.keys = self._key_buffer[:rows, :, : self.capacity]
        self.values = self._value_buffer[:rows, :, : self.capacity]

    def _set_lengths(self, lengths: list[int]) -> None:
        # Rows join, leave and are cut back between steps, not during them: one host-to-device copy.
        self.device_lengths[: len(lengths)] = torch.tensor(lengths, dtype=torch.int64)
        self.length = max(lengths, default=0)
        self._row_lengths = None if len(set(lengths)) <= 1 else lengths


class CacheStep(NamedTuple):
    """What one layer's attention needs for a step over a static :class:`KVCache`: the cache, each new
    token's slot ``positions`` (batch, new) (``capacity`` for padding), the buffer ``rows`` (batch,) the
    step's rows are (None: the first ``batch``), and ``mask`` from :func:`cache_mask`, shared by all layers."""

    cache: KVCache
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
