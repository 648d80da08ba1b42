"""Continuous batching: sequences that decode together, one forward per step, joining and leaving between steps."""

import contextlib
import functools
import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from tlm_attention import KVCache
from tlm_core.checks import check_int, check_positive_int
from tlm_core.tensors import as_index_tensor
from tlm_linear import PackedWeights
from tlm_model.inference import InferenceModel
from tlm_model.lm import TransformerLM

#: The most batch buckets (:func:`batch_buckets`): dynamo's recompile limit, past which a function with
#: more graphs silently runs eager (on CUDA every bucket is a graph of its own).
MAX_BUCKETS = 8


@functools.cache
def batch_buckets(max_batch_size: int, limit: int = MAX_BUCKETS) -> tuple[int, ...]:
    """The batch sizes a step runs at, ascending: 1, the powers of two below ``max_batch_size`` and
    ``max_batch_size`` itself, at most ``limit`` of them (the smallest powers above 1 go first: a few rows
    padded to a few more cost least). A compiled step has one graph per bucket on CUDA (on a CPU: one for a
    single row, one for every other bucket), so rows joining and leaving reuse a handful of graphs."""
    check_positive_int("max_batch_size", max_batch_size)
    check_int("limit", limit, low=2)
    powers = [1 << k for k in range(1, max_batch_size.bit_length()) if 1 << k < max_batch_size]
    above = [*powers, max_batch_size] if max_batch_size > 1 else []
    return (1, *above[len(above) - min(len(above), limit - 1) :])


def batch_bucket(rows: int, max_batch_size: int) -> int:
    """The batch size a step over ``rows`` rows runs at: the smallest of :func:`batch_buckets` that holds them."""
    return next(size for size in batch_buckets(max_batch_size) if size >= rows)


#: The fewest cache slots a compiled step reads (:func:`slot_bucket`).
MIN_SLOTS = 64


def slot_bucket(length: int, capacity: int, least: int = MIN_SLOTS) -> int:
    """How many cache slots a compiled step reads when no real token of it sits at or past slot ``length``
    (``length <= capacity``): the next power of two, at least ``least``, at most ``capacity`` (never the scratch
    slot, which only padding reads). The step's cost then follows what is stored, not the capacity; powers of
    two keep CUDA graphs (one per distinct length) few."""
    return min(capacity, max(least, 1 << max(0, length - 1).bit_length()))


class ChunkGrid(NamedTuple):
    """Where the tokens of one grid forward sit in its (rows, width) grid (:func:`pack_chunks`)."""

    rows: int
    width: int
    #: Per grid row: the chunk whose tokens it holds.
    owner: list[int]
    #: Per grid cell, row-major: the cache slot its token goes to (-1: padding).
    positions: list[int]
    #: Per chunk: its tokens' flat grid cells, in order.
    cells: list[list[int]]


def grid_width(lengths: Sequence[int]) -> int:
    """The grid width that packs chunks of ``lengths`` tokens in the fewest cells (padding included, at least 2
    rows), the widest of equals: a power of two, half the longest chunk or the longest. A decoding row's one
    token beside a prompt's chunk costs 2 cells, not the chunk's width."""
    longest = max(lengths)
    widths = {max(2, longest), max(2, -(-longest // 2)), *(1 << k for k in range(1, longest.bit_length()))}
    return min(sorted(widths, reverse=True), key=lambda w: max(2, sum(-(-n // w) for n in lengths)) * w)


def pack_chunks(lengths: Sequence[int], starts: Sequence[int]) -> ChunkGrid:
    """Lay out chunks of ``lengths`` tokens (chunk ``c`` continuing its row at slot ``starts[c]``: prompt chunks
    and decoding rows' single tokens alike) in a grid of at least 2 rows and 2 columns (:func:`grid_width`),
    each grid row a run of consecutive tokens of one chunk.

    A compiled forward specialises a size of 0 or 1 (dynamo's rule), so a forward whose rows or width could be 1
    would compile again when it is: never 1 by construction. A chunk longer than the width takes several grid
    rows (a token meets the others only through the cache, which every layer writes before it reads, so a row
    split in two computes what it would in one); one grid row alone gets a padding row."""
    width = grid_width(lengths)
    owner: list[int] = []
    positions: list[int] = []
    cells: list[list[int]] = []
    for c, (n, start) in enumerate(zip(lengths, starts, strict=True)):
        cells.append([])
        for at in range(0, n, width):
            take = min(width, n - at)
            cells[-1].extend(range(len(positions), len(positions) + take))
            positions.extend(range(start + at, start + at + take))
            positions.extend([-1] * (width - take))
            owner.append(c)
    if len(owner) == 1:
        owner.append(0)
        positions.extend([-1] * width)
    return ChunkGrid(len(owner), width, owner, positions, cells)


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` have in common (a binary search over slice comparisons, done in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if a[:mid] == b[:mid] else (low, mid - 1)
    return low


@dataclass(eq=False)
class _Held:
    """The prefix cache's record of one cache row: the prompt whose keys and values its first slots hold (a row in
    use: its whole prompt, held up to the row's length), that prompt's scores if the caller kept them, and, for a
    row in use, what it reused or waits to reuse."""

    ids: list[int] = field(default_factory=list)
    scores: list[Any] | None = None  # DecodeBatch.keep_scores: one per prompt token
    top: int = -1  # the alternatives each of ``scores`` holds
    used: int = 0  # when it last joined or lent its prefix (LRU)
    wants: int | None = None  # in use: the alternatives its own prompt scores will hold (None: not scored)
    leader: "_Held | None" = None  # in use: the prefilling row whose prompt it waits to share...
    planned: int = 0  # ... and how many tokens of it
    reused: int = 0  # in use: prompt tokens it took from another row
    prefix: list[Any] | None = None  # their scores (tokens 0 .. reused)


class DecodeBatch:
    """The rows of a decoding batch: each its own sequence at its own length in one :class:`~tlm_attention.KVCache`,
    all fed by one forward a step. This is the model-side half of a server's scheduler (vLLM v1's model runner):
    which requests join or leave, which prompt tokens run when, and how each row samples, is the caller's.

    ``join(prompt_ids)`` appends a row whose prompt is still to run; ``run(tokens, chunks)`` runs one step's plan
    in one forward: one token for every decoding row and the next ``chunks[row]`` prompt tokens of prefilling rows,
    packed into one grid (:func:`pack_chunks`), and returns their logits (a prompt row's after each of its tokens,
    for scoring, when asked). A step with no prompt tokens runs the batch-bucketed decode step (:meth:`step`).
    ``add``/``add_many`` prefill prompts and append them as rows; ``remove(row)`` lets a row go, the last row
    moving into its place (rows stay ``0 .. len(batch) - 1``). A row's logits are those of its sequence decoded
    alone, up to float rounding of the batched matmuls.

    The caches are allocated once (``max_batch_size`` rows of ``capacity`` slots, default the model's context); a
    step writes its tokens in place and reads the first :func:`slot_bucket` slots of each cache (eager: the
    longest row's length exactly), so its time follows the rows' lengths. With a model from
    :func:`~tlm_model.compile_for_inference` the step is one graph per batch bucket (:func:`batch_bucket`; on a
    CPU two in all) and prompt chunks one graph of dynamic sizes: nothing recompiles as rows join, leave and
    grow. A full row is refused a step (host-side lengths, no device read).

    **Prefix cache** (``prefix_rows`` not None; vLLM's automatic prefix caching, by whole rows). A row that leaves
    keeps its prompt's keys and values in its cache row (``remove`` swaps rows rather than overwriting one) until
    that row is taken again; ``prefix_rows`` more cache rows than ``max_batch_size`` only keep such prompts. A
    joining prompt takes the longest prefix it shares with any cache row's prompt (one in use or not): a device
    copy of those slots, and only the rest runs, the last token always (its logits). A row that leaves
    usually goes to the row the next join takes: before that join copies over it, it moves to the least
    recently used kept row. A prompt that shares a ``prefill_chunk`` more with a prompt still running than with
    anything cached waits (``join(..., wait=True)``, :attr:`waiting`; a wait costs a forward) until that prompt has
    run, then copies (:meth:`settle`). A prompt scored position by position (``scores=k``) reuses only a prefix
    whose scores the caller kept (:meth:`keep_scores`, ``k`` alternatives at least) and one token less (the next
    token's score needs the logits of the last reused position); :meth:`reused` gives them back.
    """

    def __init__(
        self,
        model: TransformerLM | InferenceModel,
        max_batch_size: int,
        capacity: int | None = None,
        *,
        prefill_chunk: int = 512,
        min_slots: int = MIN_SLOTS,
        cache: KVCache | None = None,
        prefix_rows: int | None = None,
        pack_weights: bool = False,
    ) -> None:
        """``pack_weights`` (an eager model on a CPU): decode steps at the largest batch bucket, 8 rows or more,
        run the model's Linear layers on MKL-packed copies of their float32 weights
        (:class:`tlm_linear.PackedWeights`, made here; one more copy of those weights while the batch lives)."""
        if not isinstance(model, (TransformerLM, InferenceModel)):
            raise TypeError(f"model must be a TransformerLM or an InferenceModel, got {type(model).__name__}")
        check_positive_int("max_batch_size", max_batch_size)
        check_positive_int("prefill_chunk", prefill_chunk)
        # A dynamic size of 0 or 1 would be specialised by dynamo: a compiled step always reads 2 slots or more.
        check_int("min_slots", min_slots, low=2)
        self.min_slots = min_slots
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.max_batch_size = max_batch_size
        self.prefix_rows = None if prefix_rows is None else check_int("prefix_rows", prefix_rows, low=0)
        rows = max_batch_size + (prefix_rows or 0)
        self._lm = model.model if isinstance(model, InferenceModel) else model
        if cache is None:
            cache = self._lm.new_kv_cache(rows, capacity=capacity)
        elif (cache.layers, cache.max_batch_size, cache.capacity) != (
            self._lm.config.num_layers,
            rows,
            cache.capacity if capacity is None else capacity,
        ):
            raise ValueError(
                f"cache must hold the model's {self._lm.config.num_layers} layers, {rows} rows"
                + ("" if capacity is None else f" and {capacity} slots")
                + f", got {cache.layers}, {cache.max_batch_size} and {cache.capacity}"
            )
        self.cache = cache
        self.capacity = cache.capacity
        cache.select_rows([])
        self._device = cache.device
        self._slot_ids = torch.arange(self.capacity + 1, device=self._device)
        self._slot_buckets: dict[int, Tensor] = {}  # bucket -> arange(bucket), one tensor each, made once
        self._pending: list[Tensor | None] = []  # per row: the prompt ids still to prefill, or None
        self._decoding = torch.zeros(rows, dtype=torch.int64, device=self._device)  # 1: takes tokens
        self._held = [_Held() for _ in range(rows)]  # per cache row (the prefix cache's; rows in use first)
        self._clock = itertools.count(1)
        #: Prompt tokens taken from the prefix cache so far (not run).
        self.reused_tokens = 0
        # An eager model's step may change shape: it reads only the slots up to the longest row's.
        self._eager = not isinstance(model, InferenceModel)
        lm = self._lm
        self._decode_fn: Callable[..., Tensor] = lambda tokens, positions, cache, slots: lm.forward_static(
            tokens, positions, cache, slots=slots
        )
        self._prefill_fn: Callable[..., Tensor] = lm.forward_static
        if isinstance(model, InferenceModel):
            self._decode_fn, self._prefill_fn = model.decode_step, model.prefill_step
        # A GEMM of a few rows on a weight packed for that many ran 1.5-2.7x torch.matmul's at 8 to 32 rows and
        # gained nothing below 8 (docs/benchmarks.md); the largest bucket is where a busy batch decodes.
        rows_packed = batch_buckets(max_batch_size)[-1]
        self._packed: PackedWeights | None = None
        if pack_weights and self._eager and self._device.type == "cpu" and rows_packed >= 8:
            self._packed = PackedWeights(lm, rows_packed) or None

    def __len__(self) -> int:
        return self.cache.batch_size

    @property
    def lengths(self) -> tuple[int, ...]:
        """Each row's tokens so far (prompt + tokens fed; a prefilling row: its prompt tokens run so far)."""
        return self.cache.lengths

    @property
    def prefilling(self) -> tuple[int, ...]:
        """The rows whose prompt has not finished running."""
        return tuple(r for r, ids in enumerate(self._pending) if ids is not None)

    @property
    def waiting(self) -> tuple[int, ...]:
        """The prefilling rows that wait for another row's prompt to run before they take its prefix (run no
        chunk of them: :meth:`settle` first)."""
        return tuple(r for r in range(len(self)) if self._held[r].leader is not None)

    @torch.no_grad()
    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Run one step at every batch bucket and two prompt chunks on an empty batch, so that a compiled model
        compiles now (the steps' graphs and the chunks' one graph) rather than on the first requests; the batch is
        left empty. The slots a forward reads are a dynamic size of its graph: nothing recompiles as rows grow.
        Each graph is first compiled at a size it will serve, since inductor takes the first call's sizes as hints
        for its kernels (oneDNN's weight packing, max-autotune's timings): the chunks run one prompt, then several
        of a full chunk's tokens, and the steps run from the largest bucket down. ``progress(done, total)`` is
        called after each of the ``total`` forwards."""
        if len(self):
            raise ValueError(f"warm_up needs an empty batch, this one has {len(self)} rows")
        sizes = batch_buckets(self.max_batch_size)[::-1]
        zeros = [torch.zeros(min(n, self.capacity), dtype=torch.int64) for n in range(1, 3)]
        # The tokens a warm-up row may hold and still take a step at every bucket.
        room = max(1, self.capacity - len(sizes) - 1)
        group = min(self.max_batch_size, 4)
        wide = min(self.prefill_chunk, room)
        chunks = [[torch.zeros(wide, dtype=torch.int64)]]
        if group > 1:
            chunks.append([torch.zeros(max(1, wide // group), dtype=torch.int64)] * group)
        prefix_rows, self.prefix_rows = self.prefix_rows, None  # the warm-up's prompts all run (what compiles)
        forwards: list[list[Tensor] | int] = [*chunks, *sizes]
        try:
            for done, work in enumerate(forwards, 1):
                if isinstance(work, list):  # prompts run together
                    self.add_many(work)
                    self.clear()
                else:  # a step of ``work`` rows
                    while len(self) < work:
                        self.add(zeros[min(len(self), 1)])
                    self.remove_many(range(work, len(self)))
                    if all(n < self.capacity for n in self.lengths):
                        self.step(torch.zeros(work, dtype=torch.int64, device=self._device))
                if progress is not None:
                    progress(done, len(forwards))
        finally:
            self.clear()
            self.prefix_rows = prefix_rows

    def take_over(self, source: "DecodeBatch") -> None:
        """Hold ``source``'s rows from now on, each where it was (its tokens, its prompt still to run): an
        engine switching models between steps (``tlm serve``'s compiled engine once warmed up) without
        dropping a row. This batch must be empty and of ``source``'s shape; ``source`` is left as it was."""
        if len(self):
            raise ValueError(f"take_over needs an empty batch, this one has {len(self)} rows")
        if (self.max_batch_size, self.capacity) != (source.max_batch_size, source.capacity):
            raise ValueError(
                f"source must have {self.max_batch_size} rows of {self.capacity} slots, got "
                f"{source.max_batch_size} of {source.capacity}"
            )
        if self.prefix_rows != source.prefix_rows:
            raise ValueError(f"source must have prefix_rows={self.prefix_rows}, got {source.prefix_rows}")
        self.cache.copy_from(source.cache)
        self._pending = list(source._pending)
        self._decoding.copy_(source._decoding)
        self._held, self._clock, self.reused_tokens = list(source._held), source._clock, source.reused_tokens

    def join(self, prompt_ids: Integer[Tensor, " prompt"], *, scores: int | None = None, wait: bool = False) -> int:
        """Append a row for ``prompt_ids`` without running it (see :meth:`run`); returns its index. With a
        prefix cache, ``scores`` (the alternatives the caller keeps per prompt token, :meth:`keep_scores`; None:
        the prompt is not scored) limits what it reuses, and ``wait`` lets it wait for a prompt still running
        that shares a ``prefill_chunk`` more (:attr:`waiting`). The host reads ``prompt_ids`` (give them on the
        CPU)."""
        if len(self) == self.max_batch_size:
            raise ValueError(f"the batch has room for {self.max_batch_size} rows, all in use")
        return self._join_many([prompt_ids], scores, wait)[0]

    def _join_many(self, prompts: Sequence[Tensor], scores: int | None = None, wait: bool = False) -> list[int]:
        ids = [self._checked(prompt, least=1) for prompt in prompts]
        first = len(self)
        if self.prefix_rows is None:  # one append per cache for all of them (thousands of rows join in one go)
            self.cache.append_empty_row(len(ids))
        for row, prompt in enumerate(ids, first):
            if self.prefix_rows is not None:
                held = _Held(prompt.tolist(), wants=scores)
                now, source, planned, leader = self._match(held)
                if wait and planned - now >= self.prefill_chunk:  # a wait costs a forward: worth a chunk
                    held.leader, held.planned, now = self._held[leader], planned, 0
                self._take(row, held, source, now)
                prompt = prompt[now:]
            self._pending.append(prompt.to(self._device))
        self._decoding[first : first + len(ids)] = 0
        return list(range(first, first + len(ids)))

    def _match(self, held: _Held) -> tuple[int, int, int, int]:
        """The longest prefix of ``held.ids`` a cache row holds now and its row, and the longest one a prefilling
        row will hold once its prompt has run and its row: (now, row, planned, row)."""
        best = [0, 0, 0, 0]
        lengths, rows = self.lengths, len(self)
        for b, other in enumerate(self._held):
            if other is held or not other.ids or other.ids[0] != held.ids[0]:
                continue
            # At most all but the last token (its logits); a scored prompt: one token less (the first token it runs
            # gives the next one's score) and only a prefix whose scores were kept, or will be once it has run.
            shared = shared_prefix(other.ids, held.ids) - (held.wants is not None)
            limit = min(shared, len(held.ids) - 1)
            scored = will = limit
            if held.wants is not None:
                kept = other.scores is not None and other.top >= held.wants
                scored = will = len(cast(list[Any], other.scores)) - 1 if kept else 0
                if other.wants is not None and other.wants >= held.wants:
                    will = len(other.ids) - 1
            now = max(0, min(limit, scored, lengths[b] if b < rows else len(other.ids)))
            planned = max(0, min(limit, will)) if b < rows and self._pending[b] is not None else 0
            if now > best[0]:
                best[:2] = now, b
            if planned > best[2]:
                best[2:] = planned, b
        return best[0], best[1], best[2], best[3]

    def _take(self, row: int, held: _Held, source: int, reuse: int) -> None:
        """Row ``row`` (joining, or in use and empty) is ``held`` from now on, its first ``reuse`` tokens copied
        from cache row ``source``; a joining row's cache row keeps what it held by moving it to the least
        recently used row kept (unless it is the source itself)."""
        dst, src, slots = [], [], reuse
        in_place = reuse > 0 and source == row
        lender = self._held[source]  # (in place: what the row held before)
        if reuse and not in_place:
            dst, src = [row], [source]
        if row == len(self):
            old = self._held[row]
            spare = [b for b in range(row + 1, len(self._held)) if self._held[b].used < old.used]
            if old.ids and not in_place and spare:
                lru = min(spare, key=lambda b: self._held[b].used)
                dst, src, slots = [*dst, lru], [*src, row], max(reuse, len(old.ids))
                self._held[lru] = old
            self.cache.append_empty_row(held=reuse)
        elif reuse:
            self.cache.advance([reuse if r == row else 0 for r in range(len(self))])
        self.cache.copy_rows(dst, src, slots)
        self._held[row] = held
        held.used = next(self._clock)
        if reuse:
            lender.used = held.used
            held.reused, self.reused_tokens = reuse, self.reused_tokens + reuse
            if held.wants is not None and lender.scores is not None:
                held.prefix = lender.scores[: reuse + 1]

    def settle(self) -> None:
        """Each waiting row whose leader's prompt has run (or which left) takes the longest prefix it finds now
        and runs the rest."""
        for row in self.waiting:
            held = self._held[row]
            leader = next((b for b in self.prefilling if self._held[b] is held.leader), None)
            # A scored prompt waits for its leader's scores: they are kept once its whole prompt has run.
            if leader is not None and (held.wants is not None or self.lengths[leader] < held.planned):
                continue
            held.leader = None
            reuse, source, _, _ = self._match(held)
            self._take(row, held, source, reuse)
            self._pending[row] = cast(Tensor, self._pending[row])[reuse:]

    def keep_scores(self, row: int, scores: list[Any], top: int) -> None:
        """Keep row ``row``'s prompt scores (one per token, ``top`` alternatives each) with its cached prefix: a
        later prompt scored with ``top`` alternatives at most may reuse them (:meth:`reused`)."""
        held = self._held[row]
        held.scores, held.top = scores, top

    def reused(self, row: int) -> tuple[int, list[Any] | None]:
        """How many of row ``row``'s prompt tokens came from the prefix cache, and (a scored row) the kept
        scores of its tokens 0 .. that many (as :meth:`keep_scores` got them)."""
        return self._held[row].reused, self._held[row].prefix

    @torch.no_grad()
    def refill(self, row: int, prompt_ids: Integer[Tensor, " prompt"]) -> Float[Tensor, " vocab"] | None:
        """Row ``row`` holds exactly ``prompt_ids`` from now on (a window that slid): its tokens are forgotten
        and ``prompt_ids`` prefilled alone; returns its next-token logits (None for no ids: the row is empty)."""
        check_int("row", row, low=0, high=len(self) - 1)
        ids = self._checked(prompt_ids, least=0)
        lengths = list(self.lengths)
        lengths[row] = 0
        self.cache.truncate(lengths)
        self._held[row] = _Held(ids.tolist() if self.prefix_rows is not None else [])
        if len(ids) == 0:
            self._pending[row] = None
            self._decoding[row] = 1
            return None
        self._pending[row] = ids.to(self._device)
        self._decoding[row] = 0
        while True:
            logits = self.run(None, {row: min(self.prefill_chunk, len(cast(Tensor, self._pending[row])))})[row]
            if self._pending[row] is None:
                return logits[-1]

    def _checked(self, prompt_ids: object, least: int) -> Tensor:
        if not isinstance(prompt_ids, Tensor) or prompt_ids.ndim != 1 or not least <= len(prompt_ids) <= self.capacity:
            raise ValueError(
                f"prompt_ids must be a tensor of shape (prompt,) with {least} to {self.capacity} ids, got "
                + (str(tuple(prompt_ids.shape)) if isinstance(prompt_ids, Tensor) else type(prompt_ids).__name__)
            )
        return as_index_tensor("prompt_ids", prompt_ids, self._lm.config.vocab_size, "vocab_size")

    @torch.no_grad()
    def add(self, prompt_ids: Integer[Tensor, " prompt"], *, every_position: bool = False) -> Float[Tensor, "..."]:
        """Prefill ``prompt_ids`` and append it as the last row; returns its next-token logits, shape (vocab,),
        or with ``every_position`` the logits after each prompt token, shape (prompt, vocab), from the same
        forwards (a server scoring the prompt: the last row is the next token's)."""
        return self.add_many([prompt_ids], every_position=every_position)[0]

    @torch.no_grad()
    def add_many(
        self,
        prompts: Sequence[Integer[Tensor, " _prompt"]],
        *,
        every_position: bool = False,
        budget: int | None = None,
    ) -> Float[Tensor, "n vocab"] | list[Float[Tensor, "_prompt vocab"]]:
        """Prefill ``prompts`` together (forwards of ``budget`` tokens at most, default ``prefill_chunk``) and
        append them as the last rows, in order; returns their next-token logits (with ``every_position``: a list
        of each prompt's logits after every token). Rows joined earlier and still prefilling are left as they
        are."""
        budget = self.prefill_chunk if budget is None else check_positive_int("budget", budget)
        if len(self) == self.max_batch_size:
            raise ValueError(f"the batch has room for {self.max_batch_size} rows, all in use")
        if len(self) + len(prompts) > self.max_batch_size:
            raise ValueError(
                f"the batch has room for {self.max_batch_size} rows; {len(self)} in use + {len(prompts)} new is "
                "too many"
            )
        rows = self._join_many(prompts)
        out: dict[int, list[Tensor]] = {row: [] for row in rows}
        try:
            while todo := [r for r in rows if self._pending[r] is not None]:
                plan: dict[int, int] = {}
                left = budget
                for row in todo:  # in order, each as much as the budget leaves
                    if take := min(left, len(cast(Tensor, self._pending[row]))):
                        plan[row], left = take, left - take
                for row, logits in self.run(None, plan, plan if every_position else ()).items():
                    out[row].append(logits)
        except BaseException:
            for row in reversed(rows):  # all or nothing: the new rows go again
                self.remove(row)
            raise
        if every_position:
            return [torch.cat(out[r]) for r in rows]
        return torch.stack([out[r][-1][-1] for r in rows])

    @torch.no_grad()
    def step(self, tokens: Integer[Tensor, " batch"]) -> Float[Tensor, "batch vocab"]:
        """Feed ``tokens[r]`` to row ``r``, every row in one forward; returns each row's next-token logits.

        A row still prefilling ignores its token. ``tokens`` are trusted (sampled ids): nothing is read back."""
        rows = len(self)
        if tokens.shape != (rows,):
            raise ValueError(f"tokens must have shape ({rows},), one per row, got {tuple(tokens.shape)}")
        lengths = self.lengths
        taking = [int(ids is None) for ids in self._pending]
        full = [r for r in range(rows) if taking[r] and lengths[r] >= self.capacity]
        if full:
            raise ValueError(f"rows {full} hold {self.capacity} tokens, the capacity: remove them before the next step")
        bucket = batch_bucket(rows, self.max_batch_size)
        fed = tokens.to(self._device, torch.int64)
        if bucket > rows:
            fed = torch.cat([fed, fed.new_zeros(bucket - rows)])
        # Rows past the batch (and prefilling rows) write at their own length, a slot that holds nothing
        # that counts, or the scratch slot; their lengths do not move.
        positions = self.cache.device_lengths[:bucket].unsqueeze(1)
        slots = self._slots(max(lengths) + 1)
        packed = self._packed is not None and bucket == self._packed.rows
        with cast(PackedWeights, self._packed).active() if packed else contextlib.nullcontext():
            logits = self._decode_fn(fed.unsqueeze(1), positions, self.cache, slots)
        self.cache.advance(taking, self._decoding[:rows])
        return logits[:rows]

    def _slots(self, length: int) -> Tensor:
        """``arange(n)``: the slots a forward reads when no real token sits at or past slot ``length`` (eager:
        ``n = length``; compiled: its :func:`slot_bucket`, one tensor per bucket, kept)."""
        if self._eager:
            return self._slot_ids[:length]
        n = slot_bucket(length, self.capacity, self.min_slots)
        slots = self._slot_buckets.get(n)
        if slots is None:
            slots = self._slot_buckets[n] = self._slot_ids[:n].clone()
        return slots

    def clear(self) -> None:
        """Every row leaves (at once, however many)."""
        self.cache.select_rows([])
        self._pending.clear()
        self._decoding.zero_()
        self._held = [_Held() for _ in self._held]

    def remove(self, row: int) -> int | None:
        """Drop row ``row``; the last row moves into its place. Returns the index the moved row had, or None."""
        check_int("row", row, low=0, high=len(self) - 1)
        order = self.remove_many([row])
        return order[row] if row < len(order) else None

    def remove_many(self, rows: Collection[int]) -> list[int]:
        """Drop ``rows`` at once, as :meth:`remove` one after another from the highest (each time the last row
        moves into the place left), with one copy per cache buffer. Returns the new order: the row now at ``i``
        was row ``order[i]``."""
        for row in rows:
            check_int("rows", row, low=0, high=len(self) - 1)
        order = list(range(len(self)))
        for row in sorted(set(rows), reverse=True):
            order[row] = order[-1]
            order.pop()
        if self.prefix_rows is not None:  # each keeps the prompt tokens that ran, scores included
            lengths, kept = self.lengths, set(order)
            gone = [r for r in range(len(self)) if r not in kept]
            for row in gone:
                held, have = self._held[row], lengths[row]
                held.ids, held.leader, held.wants = held.ids[:have], None, None
                held.scores = None if held.scores is None else held.scores[:have]
            self._held[: len(self)] = [self._held[r] for r in (*order, *gone)]
        self.cache.select_rows(order, keep_rest=self.prefix_rows is not None)
        self._pending = [self._pending[r] for r in order]
        decoding = self._decoding[torch.tensor(order, dtype=torch.int64, device=self._device)]
        self._decoding.zero_()
        self._decoding[: len(order)] = decoding
        return order

    @torch.no_grad()
    def run(self, tokens: Tensor | None, chunks: Mapping[int, int], every: Collection[int] = ()) -> dict[int, Tensor]:
        """One forward for one step's plan: ``tokens[r]`` fed to every decoding row ``r`` (None: no row decodes;
        a prefilling row's entry is ignored) and the next ``chunks[r]`` prompt tokens of each prefilling row ``r``.
        Returns {row: logits}: a decoding row's next-token logits (vocab,); a prompt row's after each of its
        tokens (n, vocab) when it is in ``every`` (scoring), else after its last (1, vocab), the next token's once
        its prompt is complete (it then decodes from the next step). ``tokens`` are trusted (sampled ids)."""
        for row, n in chunks.items():
            pending = self._pending[row] if 0 <= row < len(self) and self._held[row].leader is None else None
            if pending is None or not 0 < n <= len(pending):
                raise ValueError(f"chunks must name prefilling rows and 1 to their prompt tokens left, got {row}: {n}")
        if not chunks:
            if tokens is None:
                return {}
            logits = self.step(tokens)
            return {r: logits[r] for r, ids in enumerate(self._pending) if ids is None}
        decoding = [] if tokens is None else [r for r, ids in enumerate(self._pending) if ids is None]
        if full := [r for r in decoding if self.lengths[r] >= self.capacity]:
            raise ValueError(f"rows {full} hold {self.capacity} tokens, the capacity: remove them before the next step")
        fed = [] if tokens is None else list(tokens.to(self._device, torch.int64).unsqueeze(1).unbind(0))
        units = [(row, cast(Tensor, self._pending[row])[:n]) for row, n in chunks.items()]
        units += [(row, fed[row]) for row in decoding]
        lengths = self.lengths
        grid = pack_chunks([len(ids) for _, ids in units], [lengths[row] for row, _ in units])
        # One host-built copy per tensor: the ids cross to the device once, padding included.
        flat = torch.cat([ids for _, ids in units])
        cells = torch.tensor([cell for c in grid.cells for cell in c], device=self._device)
        grid_ids = torch.zeros(grid.rows * grid.width, dtype=torch.int64, device=self._device)
        grid_ids[cells] = flat
        positions = torch.tensor(grid.positions, device=self._device).view(grid.rows, grid.width)
        positions = positions.masked_fill(positions < 0, self.capacity)  # padding: the scratch slot
        index = torch.tensor([units[c][0] for c in grid.owner], device=self._device)
        wanted = [c if row in every and row in chunks else c[-1:]
                  for (row, _), c in zip(units, grid.cells, strict=True)]  # fmt: skip
        picked = [cell for c in wanted for cell in c]
        picked = picked if len(picked) >= 2 else picked * 2  # never a size of 1 (see pack_chunks)
        slots = self._slots(max(lengths[row] + len(ids) for row, ids in units))
        logits = self._prefill_fn(grid_ids.view(grid.rows, grid.width), positions, self.cache, index,
                                  torch.tensor(picked, device=self._device), slots)  # fmt: skip
        new = [0] * len(self)
        out: dict[int, Tensor] = {}
        at = 0
        for (row, ids), c in zip(units, wanted, strict=True):
            new[row] = len(ids)
            out[row] = logits[at : at + len(c)] if row in chunks else logits[at]
            at += len(c)
        self.cache.advance(new)
        for row, n in chunks.items():
            rest = cast(Tensor, self._pending[row])[n:]
            self._pending[row] = rest if len(rest) else None
            self._decoding[row] = int(not len(rest))
        return out
