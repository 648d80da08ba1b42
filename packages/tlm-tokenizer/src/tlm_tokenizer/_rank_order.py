"""BPE of a very long pre-token as whole-array steps, one per merge rank (numpy).

When every merge ranks after the merges that make its two parts (train_bpe's tables and GPT-2's do: a
merge can only use tokens that exist), a merge never creates a pair that ranks before it, so GPT-2's rule
("merge the lowest-rank pair, leftmost first") takes the ranks in increasing order and, within one rank,
every occurrence from left to right. This module does exactly that, one rank at a time over all the
positions where that pair occurs, each step a few numpy operations on those positions: the Python work
is per rank used, not per merge. Symbols live at the position of their first byte, linked to their live
neighbours (as in :func:`tlm_tokenizer.bpe.merge_heap`); a position is filed under the rank of its pair
when the pair appears and checked again when that rank's turn comes (lazy invalidation). Tables that
break the order (ranks shuffled by hand) are left to the heap.
"""

import heapq
from collections.abc import Iterable
from itertools import chain
from typing import Any

import numpy as np

from tlm_tokenizer.bpe import ID_MASK

_ID_LIMIT = 1 << 31


class RankOrderMerge:
    """``merge(parts)`` for one merge table, or ``None`` from :meth:`build` when the table's ranks are not
    in creation order."""

    def __init__(self, keys: Any, ranks: Any, left: Any, right: Any, new: Any) -> None:
        self._keys, self._ranks = keys, ranks  # the table's pairs packed as left << 32 | right, sorted
        self._left, self._right, self._new = left, right, new  # by rank: the pair and the id it makes

    @classmethod
    def build(cls, table: dict[tuple[int, int], int], symbols: Iterable[int] = ()) -> "RankOrderMerge | None":
        """The merger of ``table`` (``bpe.pack``'s values), whose pre-tokens may also hold the ids ``symbols``;
        None when a merge uses a token made at its own rank or later, or an id reaches 2**31."""
        made_ids = (packed & ID_MASK for packed in table.values())
        if max(chain(made_ids, chain.from_iterable(table), symbols), default=0) >= _ID_LIMIT:
            return None  # pairs are packed into an int64 as left << 32 | right
        made: dict[int, int] = {}  # token id -> the highest rank that makes it
        for packed in table.values():
            made[packed & ID_MASK] = max(made.get(packed & ID_MASK, -1), packed >> 32)
        for (a, b), packed in table.items():
            if made.get(a, -1) >= packed >> 32 or made.get(b, -1) >= packed >> 32:
                return None  # a merge that uses a token made at its own rank or later
        count = len(table)
        pairs = np.fromiter((i for pair in table for i in pair), dtype=np.int64, count=2 * count).reshape(-1, 2)
        values = np.fromiter(table.values(), dtype=np.int64, count=count)
        keys = pairs[:, 0] << 32 | pairs[:, 1]
        order = np.argsort(keys)
        top = int(values.max() >> 32) + 1 if len(values) else 0
        left, right, new = (np.full(top, -1, dtype=np.int64) for _ in range(3))
        ranks = values >> 32
        left[ranks], right[ranks], new[ranks] = pairs[:, 0], pairs[:, 1], values & ID_MASK
        return cls(keys[order], ranks[order], left, right, new)

    def _rank_of(self, a: Any, b: Any) -> Any:
        query = a << 32 | b  # int64: ids stay below 2**31
        found = np.searchsorted(self._keys, query)
        np.minimum(found, len(self._keys) - 1, out=found)
        return np.where(self._keys[found] == query, self._ranks[found], -1)

    @staticmethod
    def _sorted_unique(positions: Any) -> Any:
        positions.sort()
        keep = np.empty(len(positions), dtype=bool)
        keep[:1] = True
        np.not_equal(positions[1:], positions[:-1], out=keep[1:])
        return positions[keep]

    def __call__(self, parts: list[int]) -> list[int]:
        """The ids of one pre-token whose bytes have the ids ``parts`` (what :func:`tlm_tokenizer.bpe.merge` gives)."""
        n = len(parts)
        if n < 2 or not len(self._keys):
            return parts
        symbol = np.array(parts, dtype=np.int64)  # -1 once merged into its left neighbour
        after = np.arange(1, n + 1, dtype=np.int64)
        before = np.arange(-1, n - 1, dtype=np.int64)
        filed: dict[int, list[Any]] = {}
        due: list[int] = []

        def file(positions: Any, ranks: Any) -> None:
            known = ranks >= 0
            positions, ranks = positions[known], ranks[known]
            if not len(ranks):
                return
            order = np.argsort(ranks, kind="stable")  # positions stay in the text's order within a rank
            positions, ranks = positions[order], ranks[order]
            cuts = np.flatnonzero(ranks[1:] != ranks[:-1]) + 1
            for rank, chunk in zip(ranks[np.r_[0, cuts]].tolist(), np.split(positions, cuts), strict=True):
                if rank in filed:
                    filed[rank].append(chunk)
                else:
                    filed[rank] = [chunk]
                    heapq.heappush(due, rank)

        file(np.arange(n - 1), self._rank_of(symbol[:-1], symbol[1:]))
        while due:
            rank = heapq.heappop(due)
            chunks = filed.pop(rank)
            at = chunks[0] if len(chunks) == 1 else self._sorted_unique(np.concatenate(chunks))
            nxt = after[at]
            live = nxt < n
            at, nxt = at[live], nxt[live]
            a, b = self._left[rank], self._right[rank]
            live = (symbol[at] == a) & (symbol[nxt] == b)  # stale entries: the pair changed since filed
            at, nxt = at[live], nxt[live]
            if not len(at):
                continue
            if a == b and len(at) > 1:  # "aaa": overlapping occurrences, leftmost first, so every other one
                index = np.arange(len(at))
                start = np.ones(len(at), dtype=bool)
                start[1:] = at[1:] != nxt[:-1]
                first = np.maximum.accumulate(np.where(start, index, 0))
                keep = (index - first) % 2 == 0
                at, nxt = at[keep], nxt[keep]
            beyond = after[nxt]
            symbol[at] = self._new[rank]
            symbol[nxt] = -1
            after[at] = beyond
            inside = beyond < n
            before[beyond[inside]] = at[inside]
            # The pairs that changed: the merged symbol with its right neighbour, and its left neighbour with it.
            prev = before[at]
            changed = self._sorted_unique(np.concatenate([at[inside], prev[prev >= 0]]))
            file(changed, self._rank_of(symbol[changed], symbol[after[changed]]))
        return symbol[symbol >= 0].tolist()
