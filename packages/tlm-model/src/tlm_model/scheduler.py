"""The scheduler behind ``tlm serve``: one thread owns the model and runs one batched decode step a time
for every active request (continuous batching).

Requests wait in a bounded queue (:class:`QueueFull` past ``max_queue``) and join the batch between forwards while
it has fewer than ``max_batch`` rows, each with a row whose prompt is still to run. Every iteration is one forward
(vLLM v1's scheduler): the decoding rows' tokens (one each) and the prompt tokens that fit the token budget
(:meth:`Scheduler._plan`: the fewest left first, each at most ``prefill_chunk``, then what the budget leaves to the
same rows in order) run together (:meth:`tlm_model.batching.DecodeBatch.run`), so a long prompt delays the
decoding rows by one budget a step and a short prompt that arrives runs at the next forward. A request that scores
its prompt (``echo``, lm-eval's ``max_tokens`` 0 or 1) takes the same forward, with every position's logits, and
``max_tokens`` 0 ends once its prompt has run. A prompt that shares a prefix with one run before (a question's
context, a chat's history) reuses its keys and values, and an ``echo`` prompt its scores
(:class:`~tlm_model.batching.DecodeBatch`'s prefix cache; ``prefix_cache=False`` runs every prompt whole). Each row
samples with its own parameters (:mod:`tlm_model.sampling`, one call for the batch) and its own
``torch.Generator`` (seeded by its ``seed``), so its tokens do not depend on what shares its batch;
``temperature=0`` is greedy, the same as ``tlm generate --temperature 0``. Log-probabilities come from the forward
that gave the token (:func:`tlm_model.sampling.token_logprobs`).

A request leaves the batch when it ends (its token budget, an end-of-text token, a stop text) or is cancelled
(a client that went away), and its row is free for the next step. What one request raises (outside the
model's forwards) ends that request alone with ``finish_reason`` "error"; only an exception from a forward
of the model, which every row shares, ends every request and marks the scheduler failed (:attr:`error`):
it then refuses new requests (:class:`Failed`). :meth:`Scheduler.close` stops taking requests and lets the
ones in flight finish.
"""

import codecs
import collections
import dataclasses
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from tlm_model.batching import DecodeBatch
from tlm_model.inference import InferenceModel, unwrap
from tlm_model.sampling import RowParams, sample_rows, token_logprobs

#: Prompt tokens of one prompt in one forward at most while other prompts wait (DecodeBatch's ``prefill_chunk``;
#: what the budget leaves goes to the prompts in turn): a short request behind a long prompt waits for one chunk
#: of it (measured on a CPU: docs/benchmarks.md).
PREFILL_CHUNK = 32

#: Prompt tokens in one forward at most, beside the decoding rows' tokens: how long the decoding rows wait for the
#: prompts that join. Short prompts (a PREFILL_CHUNK at most) that fit it run in one forward (a burst of 16 in one
#: or two iterations).
PREFILL_BUDGET = 128

#: (prefill chunk, token budget) by device type when the caller gives none: :data:`PREFILL_CHUNK` and
#: :data:`PREFILL_BUDGET` on a CPU (measured there); on an accelerator a forward of a few thousand tokens costs
#: about what one of a few costs, so larger ones (vLLM's default token budget is 2048).
PREFILL_DEFAULTS: dict[str, tuple[int, int]] = {"cpu": (PREFILL_CHUNK, PREFILL_BUDGET), "cuda": (512, 2048)}


def prefill_defaults(device: torch.device) -> tuple[int, int]:
    """(prefill chunk, token budget) for ``device``: :data:`PREFILL_DEFAULTS`, the CPU's for an unlisted type."""
    return PREFILL_DEFAULTS.get(device.type, PREFILL_DEFAULTS["cpu"])


#: The GIL switch interval (s) while a background warm-up compiles (:meth:`Scheduler.compile_in_background`):
#: Python's default is 5 ms.
COMPILE_SWITCH_INTERVAL = 2e-4


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests already: come back later."""


class Closed(Exception):
    """The scheduler is shutting down and takes no new requests."""


class Failed(Exception):
    """The model failed (the scheduler thread stopped): no request can be served."""


@dataclass
class Scored:
    """One token with its log-probability (None: the first prompt token, which nothing predicts) and the top
    alternatives as (id, log-probability), best first."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]]


@dataclass
class Piece:
    """What the scheduler thread emits: text that can be sent now, the tokens it came from with their scores
    (when the request asked for log-probabilities), the prompt's scores (``echo``: in the first piece only),
    and on the last piece the finish reason ("stop", "length" or "error", with ``error`` saying what)."""

    text: str
    finish_reason: str | None = None
    scored: list[Scored] = field(default_factory=list)
    prompt_scored: list[Scored] | None = None
    error: str | None = None


@dataclass
class Request:
    """One completion: token ids in, :class:`Piece` s out through ``emit`` (called from the scheduler thread;
    ``finish_reason`` is None until the last piece). Values are checked where the request arrives (the HTTP
    boundary); ``temperature`` 0 is greedy; ``max_tokens`` 0 (only with ``echo``) scores the prompt alone."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[[Piece], None]
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    #: None: no log-probabilities; k: each token's and the top k (0 to 20).
    logprobs: int | None = None
    #: Score the prompt's tokens too (their log-probabilities come in the first piece).
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    #: Set from any thread to let the request go at the next step (its client disconnected).
    cancelled: threading.Event = field(default_factory=threading.Event)
    completion_tokens: int = 0
    #: time.perf_counter() of the first token (the access log's time to first token).
    first_token_at: float | None = None


class TextStream:
    """Token ids to text as they come: an incremental UTF-8 decoder (a character split across tokens comes out
    whole), held back by the longest stop text less one character, so that a stop text split across tokens
    is found before any of it is sent."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = ""
        self.hold = max(map(len, self.stops), default=1) - 1

    def add(self, token: int) -> tuple[str, bool]:
        """(text that can be sent now, whether a stop text was reached: the text before it is all that is left)."""
        # A model's vocabulary may be larger than its tokenizer's (padded): such an id has no text.
        piece = self.tokenizer.decode_bytes([token]) if token < self.tokenizer.vocab_size else b""
        self.pending += self.decoder.decode(piece)
        found = [at for at in (self.pending.find(stop) for stop in self.stops) if at >= 0]
        if found:
            text, self.pending = self.pending[: min(found)], ""
            return text, True
        cut = max(0, len(self.pending) - self.hold)
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, False

    def close(self) -> str:
        """What was held back, at the end."""
        text, self.pending = self.pending + self.decoder.decode(b"", final=True), ""
        return text


class _Row:
    """A request decoding in the batch: its text stream, generator and per-row tensors."""

    def __init__(self, request: Request, tokenizer: Any, vocab: int, device: torch.device) -> None:
        self.request = request
        self.stream = TextStream(tokenizer, request.stop)
        self.generator: torch.Generator | None = None
        if request.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(request.seed if request.seed is not None else int(time.time_ns()) % 2**63)
        self.bias: torch.Tensor | None = None
        if request.logit_bias:
            ids = torch.tensor(list(request.logit_bias), dtype=torch.long)
            values = torch.tensor(list(request.logit_bias.values()), dtype=torch.float32)
            self.bias = torch.zeros(vocab).index_put_((ids,), values).to(device)
        self.penalized = bool(request.presence_penalty or request.frequency_penalty)
        self.counts = torch.zeros(vocab, device=device) if self.penalized else None
        self.logits: torch.Tensor | None = None
        self.token: torch.Tensor | None = None  # the sampled token the next step feeds
        self.scores: list[torch.Tensor] = []  # echo: the prompt's logits after each token, chunk by chunk
        self.skipped = 0  # forwards in a row that ran none of its prompt


class Scheduler:
    """Owns ``model``: call :meth:`submit` from any thread; a daemon thread decodes (see the module doc)."""

    #: The background warm-up compiles only once the eager engine has run no step for this long (seconds)...
    compile_quiet_s = 0.5
    #: ... this long before its first forward: a server just started usually meets the clients that waited for it
    #: at once, and a compiling forward, once begun, runs to its end (tens of seconds of a CPU core and the GIL)...
    compile_start_quiet_s = 5.0
    #: ... or once this long (seconds) has passed since it was asked for (:meth:`compile_in_background`).
    compile_patience_s = 60.0

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int,
        max_queue: int,
        eos_ids: list[int],
        device: torch.device,
        warm_up: bool = False,
        prefill_chunk: int | None = None,
        token_budget: int | None = None,
        prefix_cache: bool = True,
        log: Callable[[str], None] | None = None,
    ) -> None:
        """``warm_up``: before returning, the thread runs :meth:`DecodeBatch.warm_up` (a compiled model compiles
        every batch size's step now, not on the first requests); its failure is raised here. ``prefill_chunk``:
        one prompt's tokens in one forward while others wait (:meth:`_plan`); ``token_budget``: prompt tokens in one
        forward at most (None: the device's, :func:`prefill_defaults`). ``prefix_cache``: prompts reuse the keys and
        values of a prefix another prompt ran (:class:`DecodeBatch`'s prefix cache, with ``max_batch`` cache rows
        more that only keep finished prompts). ``log``: told when a background warm-up
        (:meth:`compile_in_background`) starts, ends or fails."""
        self.model, self.tokenizer, self.device = model, tokenizer, device
        # The eager model inside any compiled wrapper (what a background warm-up compiles).
        self._plain = unwrap(model)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.vocab = model.config.vocab_size
        self.eos = set(eos_ids)
        chunk, budget = prefill_defaults(device)
        self._prefix_rows = max_batch if prefix_cache else None
        self.batch = DecodeBatch(model, max_batch, prefill_chunk=chunk if prefill_chunk is None else prefill_chunk,
                                 prefix_rows=self._prefix_rows, pack_weights=True)  # fmt: skip
        self.prefill_budget = budget if token_budget is None else token_budget
        self._waiting: collections.deque[Request] = collections.deque()
        self._rows: list[_Row] = []
        self._joining: list[Request] = []
        self._last: list[tuple[Request, Piece]] = []  # ended requests' last pieces, sent once their rows left
        self._params_rows: list[_Row] = []  # the rows _cached_params was built for
        self._cached_params: RowParams | None = None
        self._one = torch.ones(1, device=device)
        self._no_vocab = torch.zeros(self.vocab, device=device)  # a row without a bias or counts (stacked: copied)
        self._zero = torch.zeros((), dtype=torch.long, device=device)
        self._wake = threading.Condition()
        self._closing = False
        self._in_flight = 0  # waiting + decoding, counted under the lock (rows are the thread's own)
        self.steps = 0  # batched forwards so far (the tests read it)
        self.error: BaseException | None = None
        self._warm_up = warm_up
        self._log = log or (lambda line: None)
        self.engine = "compiled" if isinstance(model, InferenceModel) else "eager"
        self._warming: dict[str, Any] | None = None  # the background warm-up's progress
        self._warmed: DecodeBatch | None = None  # the compiled batch, ready to take over
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tlm-scheduler", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def compile_in_background(self) -> None:
        """Go on serving with the eager model while another thread compiles it
        (:func:`~tlm_model.compile_for_inference`) and warms a batch of its own up; between two steps the
        compiled batch then takes over every row (:meth:`DecodeBatch.take_over`), so no request is dropped or
        waits for the compiler. Each compiling forward of the warm-up waits for a quiet moment (no step for
        :attr:`compile_quiet_s`, the first for :attr:`compile_start_quiet_s`) up to :attr:`compile_patience_s`
        after this call, so that the compiler does not slow a burst of requests down (the first clients of a
        server just started among them). :meth:`engine_status` says which engine serves and how far the warm-up
        is; a failed warm-up leaves the eager engine serving."""
        if self.engine != "eager" or self._warming is not None:
            raise ValueError(f"compile_in_background needs an eager engine not yet compiling; this one is "
                             f"{self.engine}{' and compiling' if self._warming is not None else ''}")  # fmt: skip
        self._warming = {"done": 0, "total": None, "started": time.perf_counter(), "error": None}
        # Said here, not in the thread: whoever asked sees the line before any request is answered.
        self._log("warming the compiled engine up in the background; the eager engine serves meanwhile")
        threading.Thread(target=self._compile, name="tlm-compile", daemon=True).start()

    def engine_status(self) -> dict[str, Any]:
        """Which engine serves ("eager" or "compiled") and, while a background warm-up runs or after it failed,
        its progress: ``{"engine": ..., "warm_up": {"done": forwards, "total": forwards, "seconds": s,
        "error": None or what it raised}}``."""
        status: dict[str, Any] = {"engine": self.engine}
        warming = self._warming
        if warming is not None and (self.engine == "eager" or warming["error"]):
            seconds = round(time.perf_counter() - warming["started"], 1)
            status["warm_up"] = {"done": warming["done"], "total": warming["total"], "seconds": seconds,
                                 "error": warming["error"]}  # fmt: skip
        return status

    def _compile(self) -> None:
        """The background warm-up (its own thread): compile the model, warm a batch of its own up, and hand it
        to the scheduler thread, which switches to it between two steps."""
        from tlm_model import compile_for_inference

        warming = cast(dict[str, Any], self._warming)

        deadline = time.monotonic() + self.compile_patience_s

        def progress(done: int, total: int) -> None:
            warming["done"], warming["total"] = done, total
            if done < total:  # the next forward compiles; after the last, the batch is handed over at once
                self._wait_quiet(deadline, self.compile_quiet_s)

        self._wait_quiet(deadline, self.compile_start_quiet_s)
        # The compiler is Python and holds the GIL; the serving thread gives it up for every torch call and, by
        # default, waits up to 5 ms to get it back each time (hundreds of times a forward). A short switch
        # interval while the compiler runs hands the GIL back within a fraction of that.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, COMPILE_SWITCH_INTERVAL))
        try:
            with torch.inference_mode():  # the graphs are compiled under the mode the steps run in
                batch = DecodeBatch(compile_for_inference(cast(Any, self._plain)), self.max_batch,
                                    prefill_chunk=self.batch.prefill_chunk, prefix_rows=self._prefix_rows)  # fmt: skip
                batch.warm_up(progress)
        except Exception as err:
            warming["error"] = f"{type(err).__name__}: {err}"
            self._log(f"the compiled engine's warm-up failed ({warming['error']}); the eager engine serves on")
            return
        finally:
            sys.setswitchinterval(interval)
        with self._wake:
            self._warmed = batch
            self._wake.notify()

    def _wait_quiet(self, deadline: float, quiet: float) -> None:
        """The background warm-up's gate before each compiling forward: return once the eager engine has run no
        step for ``quiet`` seconds (a burst of requests is served without the compiler taking the CPU and the GIL
        from it), or at ``deadline`` (a server never quiet still gets its compiled engine)."""
        while time.monotonic() < deadline:
            seen = self.steps
            time.sleep(min(quiet, max(0.0, deadline - time.monotonic())))
            if self.steps == seen:
                return

    def _switch(self) -> None:
        """The scheduler thread: the warmed compiled batch takes over every row of the eager one."""
        warmed, self._warmed = cast(DecodeBatch, self._warmed), None
        warmed.take_over(self.batch)
        self.batch, self.engine = warmed, "compiled"
        seconds = time.perf_counter() - cast(dict[str, Any], self._warming)["started"]
        self._log(f"the compiled engine serves from now on (warm-up {seconds:.0f} s)")

    # ------------------------------------------------------------------ any thread

    def submit(self, request: Request) -> None:
        """Queue ``request``; raises :class:`QueueFull`, :class:`Closed` or :class:`Failed` instead."""
        self.submit_all([request])

    def submit_all(self, requests: list[Request]) -> None:
        """Queue every one of ``requests`` or none (the choices of one HTTP request)."""
        with self._wake:
            if self.error is not None:
                raise Failed(f"the model failed: {type(self.error).__name__}: {self.error}")
            if self._closing:
                raise Closed("the server is shutting down")
            if self._in_flight + len(requests) > self.max_batch + self.max_queue:
                raise QueueFull(
                    f"{self.active} requests are decoding and {self.waiting} waiting already (--max-batch "
                    f"{self.max_batch}, --max-queue {self.max_queue})"
                )
            self._in_flight += len(requests)
            self._waiting.extend(requests)
            self._wake.notify()

    @property
    def capacity(self) -> int:
        """Requests in flight at most (rows and queue)."""
        return self.max_batch + self.max_queue

    @property
    def active(self) -> int:
        return len(self._rows)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def close(self, timeout: float) -> bool:
        """Take no new requests; wait up to ``timeout`` s for those in flight. True if they all finished."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():  # past the timeout: the rest are told they ended, and the thread stops
            with self._wake:
                for request in [*self._waiting, *(row.request for row in self._rows)]:
                    request.cancelled.set()
                self._wake.notify()
            self._thread.join(5.0)
            return False
        return True

    # ------------------------------------------------------------------ the scheduler thread

    def _left(self, count: int) -> None:
        with self._wake:
            self._in_flight -= count

    @torch.inference_mode()  # the warm-up's graphs are compiled under the mode the steps run in
    def _loop(self) -> None:
        try:
            if self._warm_up:
                self.batch.warm_up()
        except BaseException as err:
            self.error = err
            return
        finally:
            self._ready.set()
        try:
            while self._next_step():
                pass
        except BaseException as err:  # the model failed: every request in flight ends, and the server says so
            with self._wake:
                self.error = err
                every = [*self._waiting, *self._joining, *(row.request for row in self._rows)]
                ended = [request for request in every if not request.cancelled.is_set()]  # not answered yet
                self._waiting.clear()
            message = f"the model failed: {type(err).__name__}: {err}"
            for request in ended:
                _emit_quietly(request, Piece("", "error", error=message))
            traceback.print_exception(err)

    def _fail(self, request: Request, err: BaseException) -> None:
        """``request`` alone ends with an error (what it raised); the scheduler goes on."""
        request.cancelled.set()
        _emit_quietly(request, Piece("", "error", error=f"the request failed: {type(err).__name__}: {err}"))

    def _next_step(self) -> bool:
        with self._wake:
            while not self._rows and not self._waiting and self._warmed is None:
                if self._closing:
                    return False
                self._wake.wait()
        if self._warmed is not None:
            self._switch()  # a failure here is the engine's: _loop ends it all
        self._admit()
        if not self._rows:
            return True
        self.batch.settle()
        plan = self._plan()
        decoding = any(row.token is not None for row in self._rows)
        tokens = (
            torch.stack([self._zero if row.token is None else row.token for row in self._rows]) if decoding else None
        )
        every = [r for r in plan if self._rows[r].request.echo]
        out = self.batch.run(tokens, plan, every)  # the model's: a failure ends everything
        self.steps += 1
        prefilling = set(self.batch.prefilling)
        for r, logits in out.items():
            row = self._rows[r]
            if r not in plan:
                row.logits = logits
                continue
            if row.request.echo:
                row.scores.append(logits)
            if r not in prefilling:
                self._prompt_done(r, logits[-1])
        self._sample_ready()
        self._drop_ended()
        return True

    def _plan(self) -> dict[int, int]:
        """Prompt tokens per prefilling row for this iteration's forward, at most ``prefill_budget`` in all: the
        fewest left first (a burst of short prompts completes together), each at most ``prefill_chunk``; what the
        budget leaves then goes to the same rows in turn (a lone long prompt takes it all). A row passed over
        twice goes first, so that prompts joining every step never starve a long one."""
        lengths, budget = self.batch.lengths, self.prefill_budget
        ready = set(self.batch.prefilling) - set(self.batch.waiting)
        left = {r: len(self._rows[r].request.prompt) - lengths[r] for r in ready}
        order = sorted(left, key=lambda r: (self._rows[r].skipped < 2, left[r]))
        plan: dict[int, int] = {}
        for cap in (self.batch.prefill_chunk, budget):
            for r in order:
                take = min(cap - plan.get(r, 0), left[r] - plan.get(r, 0), budget)
                if take > 0:
                    plan[r], budget = plan.get(r, 0) + take, budget - take
        for r in left:
            self._rows[r].skipped = 0 if r in plan else self._rows[r].skipped + 1
        return plan

    def _prompt_done(self, r: int, logits: torch.Tensor) -> None:
        """Row ``r``'s prompt has run: its scores go out (``echo``; those of a prefix it reused were kept by the
        row that ran it), then it samples its first token from ``logits``, or ends (``max_tokens`` 0)."""
        row = self._rows[r]
        request = row.request
        try:
            if request.echo:
                k = request.logprobs or 0
                start, kept = self.batch.reused(r)
                head = [Scored(s.token, s.logprob, s.top[:k]) for s in kept or [Scored(request.prompt[0], None, [])]]
                prompt = torch.tensor(request.prompt[start + 1 :], device=self.device)
                scored = [*head, *self._score(torch.cat(row.scores)[:-1], prompt, k)]
                row.scores = []
                if self._prefix_rows is not None:
                    self.batch.keep_scores(r, scored, k)
                request.emit(Piece("", prompt_scored=scored))
            if request.max_tokens == 0:
                request.cancelled.set()
                self._last.append((request, Piece("", "length")))
            else:
                row.logits = logits
        except Exception as err:
            self._fail(request, err)  # its row leaves at this step, as a cancelled one does

    def _sample_ready(self) -> None:
        """Sample the rows that have next-token logits in one call, each keeping its token for the next step; a
        row that raises ends alone (its request fails) and its token is 0 (it leaves)."""
        rows = [row for row in self._rows if row.logits is not None]
        if not rows:
            return
        stacked = torch.stack([cast(torch.Tensor, row.logits) for row in rows])
        try:
            tokens = self._sample_batch(rows, stacked)
        except Exception:  # some row's parameters break the batched call: sample row by row to find it
            tokens = torch.zeros(len(rows), dtype=torch.long, device=self.device)
            for r, row in enumerate(rows):
                try:
                    tokens[r] = self._sample_batch([row], stacked[r : r + 1])[0]
                except Exception as err:
                    self._fail(row.request, err)
        want = max((row.request.logprobs for row in rows if row.request.logprobs is not None), default=None)
        scores = [] if want is None else self._score(stacked, tokens, want)
        # The one read of the step back to the host: the text needs the ids.
        for r, (row, token_id) in enumerate(zip(rows, tokens.tolist(), strict=True)):
            row.token, row.logits = tokens[r], None
            request = row.request
            if request.cancelled.is_set():
                continue
            try:
                if row.counts is not None:
                    row.counts.index_add_(0, tokens[r : r + 1], self._one)
                k = request.logprobs
                self._took(row, token_id, [] if k is None else [dataclasses.replace(scores[r], top=scores[r].top[:k])])
            except Exception as err:
                self._fail(request, err)

    def _drop_ended(self) -> None:
        """Ended and cancelled rows leave (the last row takes each one's place); then the last pieces of the
        requests that ended go out (one that raises fails alone)."""
        ended = [r for r, row in enumerate(self._rows) if row.request.cancelled.is_set()]
        if ended:
            self._rows = [self._rows[r] for r in self.batch.remove_many(ended)]
            self._left(len(ended))
        last, self._last = self._last, []
        for request, piece in last:
            try:
                request.emit(piece)
            except Exception as err:
                self._fail(request, err)

    def _admit(self) -> None:
        """Waiting requests take the free rows, each with its prompt to run."""
        with self._wake:
            joining: list[Request] = []
            while self._waiting and len(self._rows) + len(joining) < self.max_batch:
                joining.append(self._waiting.popleft())
            self._joining = joining  # neither waiting nor in a row until they join: a model failure ends them too
        for request in joining:
            if request.cancelled.is_set():
                self._left(1)
                continue
            try:
                row = _Row(request, self.tokenizer, self.vocab, self.device)
            except Exception as err:
                self._fail(request, err)
                self._left(1)
                continue
            scores = (request.logprobs or 0) if request.echo else None
            self.batch.join(torch.tensor(request.prompt), scores=scores, wait=True)
            self._rows.append(row)
        self._joining = []

    def _score(self, logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[Scored]:
        """``tokens`` scored under ``logits`` (one row each), read back to the host."""
        picked, values, indices = token_logprobs(logits, tokens, top)
        return [
            Scored(token, logprob, list(zip(ids, lps, strict=True)))
            for token, logprob, ids, lps in zip(
                tokens.tolist(), picked.tolist(), indices.tolist(), values.tolist(), strict=True
            )
        ]

    def _sample_batch(self, rows: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        generators = [row.generator for row in rows]
        any_top_p = any(row.generator is not None and row.request.top_p is not None for row in rows)
        return sample_rows(logits, self._params(rows), generators, any_top_p=any_top_p)

    def _params(self, rows: list[_Row]) -> RowParams:
        """The rows' sampling parameters as tensors: built (one copy to the device) when the rows change, reused
        while they stay; only the generated-token counts (for penalties) are stacked every step."""
        if rows != self._params_rows or self._cached_params is None:  # (rows compare by identity)
            requests = [row.request for row in rows]
            values = torch.tensor([
                [r.temperature if r.temperature > 0 else 1.0 for r in requests],
                [r.top_p if r.top_p is not None else 2.0 for r in requests],
                [r.presence_penalty for r in requests],
                [r.frequency_penalty for r in requests],
            ], dtype=torch.float32).to(self.device)  # fmt: skip
            sampled = [r for r, row in enumerate(rows) if row.generator is not None]
            bias = None
            if any(row.bias is not None for row in rows):
                bias = torch.stack([row.bias if row.bias is not None else self._no_vocab for row in rows])
            self._cached_params = RowParams(
                temperature=values[0], top_p=values[1], presence=values[2], frequency=values[3], bias=bias,
                sampled=torch.tensor(sampled, dtype=torch.long).to(self.device) if sampled else None,
            )  # fmt: skip
            self._params_rows = list(rows)
        if not any(row.penalized for row in rows):
            return self._cached_params
        counts = torch.stack([row.counts if row.counts is not None else self._no_vocab for row in rows])
        return dataclasses.replace(self._cached_params, counts=counts)

    def _took(self, row: _Row, token_id: int, scored: list[Scored]) -> None:
        """``row`` took ``token_id``: emit its text, and end it at an end-of-text token, a stop text or its budget."""
        request = row.request
        request.completion_tokens += 1
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        # An ended request's last piece goes out once its row has left (_drop_ended), so that a client told it
        # ended never finds it counted active.
        if token_id in self.eos:
            request.cancelled.set()
            self._last.append((request, Piece(row.stream.close(), "stop", scored)))
            return
        text, stopped = row.stream.add(token_id)
        if stopped:
            request.cancelled.set()
            self._last.append((request, Piece(text, "stop", scored)))
        elif request.completion_tokens >= request.max_tokens:
            request.cancelled.set()
            self._last.append((request, Piece(text + row.stream.close(), "length", scored)))
        elif text or scored:
            request.emit(Piece(text, None, scored))


def _emit_quietly(request: Request, piece: Piece) -> None:
    try:
        request.emit(piece)
    except Exception:  # its listener is gone or broken: nothing more to tell it
        pass
