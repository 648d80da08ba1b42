"""Per-layer key/value cache for incremental decoding, with a length per row."""

from collections.abc import Sequence

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
        self._key_buffer = torch.zeros(shape, device=device, dtype=dtype)
        self._value_buffer = torch.zeros(shape, device=device, dtype=dtype)
        self.keys, self.values = self._key_buffer, self._value_buffer  # the rows in use: views of the buffers
        self.capacity = capacity
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
        """(batch, new) int64 positions of the next ``new`` tokens of each row: its length onwards."""
        steps = torch.arange(new, device=self.keys.device)
        return torch.tensor(self.lengths, device=self.keys.device).unsqueeze(1) + steps

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
            # Row b's token t goes to slot positions[b, t]: one scatter along the slot axis.
            index = positions.to(torch.int64)[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
            self.keys.scatter_(2, index, keys)
            self.values.scatter_(2, index, values)
            if self._row_lengths is not None:
                self._row_lengths = [n + new for n in self._row_lengths]
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
        self.length, self._row_lengths = length, None

    def reset(self) -> None:
        """Every row in use empty again."""
        self.length, self._row_lengths = 0, None

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
        if self.batch_size == self.max_batch_size:
            raise ValueError(f"the KV cache has room for {self.max_batch_size} rows, all in use")
        lengths = self.lengths
        self._use_rows(self.batch_size + 1)
        self._set_lengths([*lengths, 0])
        self.set_row(self.batch_size - 1, source, row)
        return self.batch_size - 1

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

    def _use_rows(self, rows: int) -> None:
        self.keys, self.values = self._key_buffer[:rows], self._value_buffer[:rows]

    def _set_lengths(self, lengths: list[int]) -> None:
        self.length = max(lengths, default=0)
        self._row_lengths = None if len(set(lengths)) <= 1 else lengths
