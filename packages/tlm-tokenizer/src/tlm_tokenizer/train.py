"""Byte-level BPE training with the course's semantics (CS336 assignment 1, §2.4-2.5).

Pre-tokens are counted once (in parallel over file ranges for large inputs); the merge loop then
works on distinct pre-tokens weighted by their counts. Pair counts are updated incrementally: an
index from each pair to the words that contain it limits each merge to the words it touches, and
a heap with lazy deletion finds the most frequent pair, ties going to the greater ``(bytes, bytes)``.
"""

import heapq
import itertools
import math
import os
from collections import defaultdict
from collections.abc import Iterable

from tlm_core.checks import check_int, check_positive_int
from tlm_core.progress import progress_bar
from tlm_tokenizer._chunks import read_range, split_file
from tlm_tokenizer._gc import gc_paused
from tlm_tokenizer.pretokenize import count_pretokens, special_splitter

__all__ = ["train_bpe"]

_PARALLEL_MIN_BYTES = 4 << 20  # below this, process start-up costs more than it saves
_RANGE_BYTES = 64 << 20  # bounds each worker's text in memory
_PROGRESS_MIN_BYTES = 16 << 20


def _reverse_key(token: bytes) -> tuple[int, ...]:
    """A key whose order is the reverse of ``bytes`` order: x > y exactly when key(x) < key(y).

    Each byte c becomes 255 - c, and the end becomes 256, above any byte, so a proper prefix (smaller as
    bytes) gets the greater key. Python's min-heap then pops the lexicographically greatest pair first.
    """
    return (*(255 - byte for byte in token), 256)


def _count_range(path: str, start: int, end: int, special_tokens: list[str]) -> dict[str, int]:
    return count_pretokens(read_range(path, start, end), special_splitter(special_tokens))


def _check_arguments(input_path: object, vocab_size: object, special_tokens: object) -> list[str]:
    if not isinstance(input_path, str | os.PathLike):
        raise TypeError(f"input_path must be a str or os.PathLike, got {type(input_path).__name__}")
    if isinstance(special_tokens, str) or not isinstance(special_tokens, Iterable):
        raise TypeError(f"special_tokens must be a list of str, got {type(special_tokens).__name__}")
    specials = list(special_tokens)
    bad = [token for token in specials if not isinstance(token, str) or not token]
    if bad:
        raise TypeError(f"special_tokens must hold non-empty str, got {bad[0]!r}")
    specials = list(dict.fromkeys(specials))
    size = check_int("vocab_size", vocab_size)
    if size < 256 + len(specials):
        least = 256 + len(specials)
        raise ValueError(
            f"vocab_size must be at least {least} (256 bytes + {len(specials)} special tokens), got {size}"
        )
    return specials


def count_file(
    input_path: str | os.PathLike,
    special_tokens: list[str],
    num_workers: int | None = None,
    progress: bool | None = None,
) -> dict[str, int]:
    """Pre-token -> count over a whole UTF-8 file, split across ``num_workers`` processes."""
    workers = min(os.cpu_count() or 1, 8) if num_workers is None else check_positive_int("num_workers", num_workers)
    # Imported here: tlm_core.atomic (secrets, shutil, ...) is the encoder's file handling, which the trainer's
    # import leaves out (test_imports); a FIFO, device or folder is one line, never waited on.
    from tlm_core.atomic import check_input

    check_input(input_path, "input_path")
    size = os.path.getsize(input_path)
    if size < _PARALLEL_MIN_BYTES:
        workers = 1
    ranges = split_file(input_path, max(workers, math.ceil(size / _RANGE_BYTES)), special_tokens)
    path = os.fspath(input_path)
    show = progress if progress is not None else (None if size >= _PROGRESS_MIN_BYTES else False)
    bar = progress_bar(show, total=size, unit="B", unit_scale=True, desc="pre-tokenising")
    totals: dict[str, int] = {}
    with bar:
        if workers == 1 or len(ranges) == 1:
            results: Iterable[dict[str, int]] = (_count_range(path, a, b, special_tokens) for a, b in ranges)
            pool = None
        else:
            import multiprocessing  # here, not at the top: importing it slows every short run
            from concurrent.futures import ProcessPoolExecutor

            context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
            pool = ProcessPoolExecutor(min(workers, len(ranges)), mp_context=context)
            results = pool.map(_count_range, *zip(*[(path, a, b, special_tokens) for a, b in ranges], strict=True))
        try:
            for (start, end), counts in zip(ranges, results, strict=True):
                if totals:
                    for token, count in counts.items():
                        totals[token] = totals.get(token, 0) + count
                else:
                    totals = counts
                bar.update(end - start)
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    return totals


def merge_counts(
    pretoken_counts: dict[str, int], vocab_size: int, special_tokens: list[str], progress: bool | None = None
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Run the BPE merge loop on pre-token counts. Ids: 0-255 bytes, then specials, then merges."""
    with gc_paused():  # the loop's tuples, lists and sets form no cycles
        return _merge_counts(pretoken_counts, vocab_size, special_tokens, progress)


def _merge_counts(
    pretoken_counts: dict[str, int], vocab_size: int, special_tokens: list[str], progress: bool | None
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    vocab: dict[int, bytes] = {byte: bytes([byte]) for byte in range(256)}
    for token in special_tokens:
        vocab[len(vocab)] = token.encode("utf-8")
    merges: list[tuple[bytes, bytes]] = []

    # Each pair's word list (a word appears once per occurrence) gives both its count (the sum of
    # those words' counts) and its index (the set of them), summed and deduplicated in C.
    kept = [(encoded, count) for token, count in pretoken_counts.items() if len(encoded := token.encode("utf-8")) > 1]
    words = [list(encoded) for encoded, _ in kept]
    freqs = [count for _, count in kept]
    occurrences: defaultdict[tuple[int, int], list[int]] = defaultdict(list)
    for index, word in enumerate(words):
        for pair in itertools.pairwise(word):
            occurrences[pair].append(index)
    count_of = freqs.__getitem__
    pair_counts = {pair: sum(map(count_of, indices)) for pair, indices in occurrences.items()}
    where = {pair: set(indices) for pair, indices in occurrences.items()}
    del occurrences

    # Heap entries (-count, key(left), key(right), left, right): key() reverses byte order (see _reverse_key),
    # so ties pop the lexicographically greatest pair, compared in C rather than by a Python __lt__.
    keys = [_reverse_key(token) for token in vocab.values()]
    heap = [(-count, keys[a], keys[b], a, b) for (a, b), count in pair_counts.items()]
    heapq.heapify(heap)
    wanted = vocab_size - len(vocab)
    show = progress if progress is not None else (None if wanted >= 2000 else False)
    with progress_bar(show, total=max(wanted, 0), desc="merging") as bar:
        while len(vocab) < vocab_size and heap:
            negative, key_a, key_b, a, b = heapq.heappop(heap)
            count = pair_counts.get((a, b), 0)
            if count != -negative:
                if count > 0:  # stale entry: counts only fall for old pairs, so re-file it lower
                    heapq.heappush(heap, (-count, key_a, key_b, a, b))
                continue
            new = len(vocab)
            vocab[new] = vocab[a] + vocab[b]
            keys.append(_reverse_key(vocab[new]))
            merges.append((vocab[a], vocab[b]))
            created: dict[tuple[int, int], None] = {}
            # Inlined word update (this loop is the trainer's hot spot). At each occurrence of (a, b)
            # the pair to its left (with the symbol already written, possibly `new`) and the pair to
            # its right change; a right-side increment is cancelled by the next occurrence's left
            # side, so `a b a b` nets one (new, new) and loses one (b, a). Every pair that gains
            # contains `new`, so only those need this word in their index; (a, b) itself is dropped.
            for index in where.pop((a, b)):
                word = words[index]
                # The index may name words that lost the pair to an earlier merge, so count first. Walking
                # the occurrences of `a` with list.index (C speed) by count, not until a ValueError, keeps
                # exceptions out of the loop: raising one cost more than the rest of a visit.
                unseen = word.count(a)
                if not unseen:
                    continue
                n = len(word)
                freq = freqs[index]
                merged: list[int] | None = None
                start = i = 0  # word[start:] is not copied into `merged` yet
                while unseen:
                    i = word.index(a, i)
                    unseen -= 1
                    if i + 1 < n and word[i + 1] == b:
                        if a == b:
                            unseen -= 1  # word[i + 1] is an `a` too, merged away here
                        if merged is None:
                            merged = word[:i]
                        else:
                            merged += word[start:i]
                        if merged:
                            left = merged[-1]
                            pair_counts[(left, a)] -= freq
                            pair = (left, new)
                            pair_counts[pair] = pair_counts.get(pair, 0) + freq
                            created[pair] = None
                            indexed = where.get(pair)
                            if indexed is None:
                                where[pair] = {index}
                            else:
                                indexed.add(index)
                        if i + 2 < n:
                            right = word[i + 2]
                            pair_counts[(b, right)] -= freq
                            pair = (new, right)
                            pair_counts[pair] = pair_counts.get(pair, 0) + freq
                            created[pair] = None
                            indexed = where.get(pair)
                            if indexed is None:
                                where[pair] = {index}
                            else:
                                indexed.add(index)
                        merged.append(new)
                        start = i = i + 2
                    else:
                        i += 1
                if merged is not None:
                    merged += word[start:]
                    words[index] = merged
            del pair_counts[(a, b)]
            for pair in created:
                x, y = pair
                if pair_counts[pair] > 0:
                    heapq.heappush(heap, (-pair_counts[pair], keys[x], keys[y], x, y))
            bar.update(1)
    return vocab, merges


def train_bpe(
    input_path: str | os.PathLike,
    vocab_size: int,
    special_tokens: list[str],
    *,
    num_workers: int | None = None,
    progress: bool | None = None,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE vocabulary on a UTF-8 text file.

    The vocabulary starts with the 256 byte values (ids 0-255) and ``special_tokens`` (next ids),
    all counted in ``vocab_size``. The text is split at the special tokens first, so no merge
    crosses one; pre-tokens come from GPT-2's pattern; each step merges the most frequent pair
    (ties: the lexicographically greater ``(bytes, bytes)``). Stops early if no pair is left.

    Args:
        num_workers: processes for pre-tokenisation (default: CPU count, at most 8; files under
            4 MiB always use one).
        progress: show tqdm bars (default: for large inputs, and only when stderr is a terminal).

    Returns:
        ``(vocab, merges)``: id -> token bytes, and the merges in the order they were made.
    """
    specials = _check_arguments(input_path, vocab_size, special_tokens)
    counts = count_file(input_path, specials, num_workers=num_workers, progress=progress)
    return merge_counts(counts, vocab_size, specials, progress=progress)
