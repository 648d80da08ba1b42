"""Byte-pair merging of one pre-token: merge the adjacent pair of lowest rank, leftmost first, until
no pair has a rank. This is GPT-2's rule, and what tiktoken and HF tokenizers compute.

Both functions work on ids. ``table[(left, right)]`` packs ``rank << 32 | merged_id`` (see
:func:`pack`), so comparing packed values compares ranks and the low bits give the new id. A short
pre-token (a word) is merged by scanning a list for its minimum after every merge: O(n²), but with
little work per step, so it is the faster one for words. A long one (a line without whitespace can be
one pre-token of megabytes) takes pairs in order of (rank, position) with lazy invalidation, from a
sorted list and a heap, as the Rust cores of tiktoken and HF tokenizers do with a heap: O(n log n).
"""

import heapq
from array import array
from itertools import pairwise, repeat

__all__ = ["HEAP_MIN", "ID_MASK", "NO_RANK", "RANK_ORDER_MIN", "merge", "merge_heap", "merge_scan", "pack"]

ID_MASK = (1 << 32) - 1
NO_RANK = 1 << 62  # above every packed value: ranks stay below 2**30
# Pre-tokens of at least this many bytes take the heap; below, the scan (every word is far below). Where the
# two cross: docs/benchmarks.md.
HEAP_MIN = 160
# Pre-tokens of at least this many bytes take whole-array steps, one per rank (tlm_tokenizer._rank_order,
# numpy), where the table allows it; the heap below (docs/benchmarks.md).
RANK_ORDER_MIN = 1 << 16


def pack(rank: int, merged_id: int) -> int:
    """The value a merge table holds for a pair: its rank in the high bits, the id it merges to below."""
    return rank << 32 | merged_id


def merge(parts: list[int], table: dict[tuple[int, int], int]) -> list[int]:
    """The ids of one pre-token whose bytes have the ids ``parts`` (a list this function may modify)."""
    if len(parts) < HEAP_MIN:
        return merge_scan(parts, table)
    return merge_heap(parts, table)


def merge_scan(parts: list[int], table: dict[tuple[int, int], int]) -> list[int]:
    """:func:`merge` by rescanning the packed ranks of all pairs for their minimum after each merge."""
    packed = list(map(table.get, pairwise(parts), repeat(NO_RANK)))
    while packed:
        best = min(packed)
        if best == NO_RANK:
            break
        i = packed.index(best)  # the leftmost pair of that rank
        parts[i] = best & ID_MASK
        del parts[i + 1]
        del packed[i]
        # Only the pairs on either side of the merged symbol change.
        if i > 0:
            packed[i - 1] = table.get((parts[i - 1], parts[i]), NO_RANK)
        if i < len(packed):
            packed[i] = table.get((parts[i], parts[i + 1]), NO_RANK)
    return parts


def merge_heap(parts: list[int], table: dict[tuple[int, int], int]) -> list[int]:
    """:func:`merge` taking pairs in order of ``rank << 32 | position`` from a sorted list and a min-heap.

    A symbol lives at the position of its first byte and is linked to its live neighbours. The pairs
    of the bytes are sorted once (in C); the pairs that merges create go into a heap, small beside
    them; each step takes the smaller of the two heads: the pair of lowest rank, leftmost on ties
    (positions keep the text's order). An entry goes stale when a merge changes either symbol of its
    pair; it is skipped when taken (its pair's rank now differs) rather than searched for and removed.
    """
    n = len(parts)
    get = table.get
    symbol = parts  # symbol[i] = -1 once position i was merged into its left neighbour
    right = array("q", range(1, n + 1))  # arrays: a list of n ints would hold n int objects
    left = array("q", range(-1, n - 1))
    initial = [p >> 32 << 32 | i for i, p in enumerate(map(get, pairwise(parts), repeat(NO_RANK))) if p != NO_RANK]
    initial.sort()
    heap: list[int] = []
    pop, push = heapq.heappop, heapq.heappush
    taken, total = 0, len(initial)
    while True:
        if heap and (taken == total or heap[0] < initial[taken]):
            key = pop(heap)
        elif taken < total:
            key = initial[taken]
            taken += 1
        else:
            break
        i = key & ID_MASK
        j = right[i]
        if j == n:
            continue  # i is the last symbol now (or was merged away)
        packed = get((symbol[i], symbol[j]), NO_RANK)
        if packed >> 32 != key >> 32:
            continue  # stale: the pair at i changed since this entry was made
        new = symbol[i] = packed & ID_MASK
        symbol[j] = -1
        k = right[i] = right[j]
        if k < n:
            left[k] = i
            after = get((new, symbol[k]))
            if after is not None:
                push(heap, after >> 32 << 32 | i)
        h = left[i]
        if h >= 0:
            before = get((symbol[h], new))
            if before is not None:
                push(heap, before >> 32 << 32 | h)
    return [s for s in symbol if s >= 0]
