"""The scheduler behind ``tlm serve``: one thread owns the model and runs one batched decode step a time
for every active request (continuous batching).

Requests wait in a bounded queue (:class:`QueueFull` past ``max_queue``) and join the batch between
steps while it has fewer than ``max_batch`` rows: each joins with its prompt run alone
(:meth:`tlm_model.batching.DecodeBatch.add`), then every step feeds one token to every row in one
forward. Each request samples from its own row with its own ``torch.Generator`` (seeded by its
``seed``), so its tokens do not depend on what shares its batch; ``temperature=0`` is greedy, the
same as ``tlm generate --temperature 0``. A request leaves the batch when it ends (its token budget,
an end-of-text token, a stop text) or is cancelled (a client that went away), and its row is free
for the next step. :meth:`Scheduler.close` stops taking requests and lets the ones in flight finish.
"""

import codecs
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tlm_model import sample_next_token
from tlm_model.batching import DecodeBatch


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests already: come back later."""


class Closed(Exception):
    """The scheduler is shutting down and takes no new requests."""


@dataclass
class Request:
    """One completion: token ids in, text out through ``emit(text, finish_reason)`` (called from the scheduler
    thread; ``finish_reason`` is None until the last call, then "stop" or "length")."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[[str, str | None], None]
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    #: Set from any thread to let the request go at the next step (its client disconnected).
    cancelled: threading.Event = field(default_factory=threading.Event)
    completion_tokens: int = 0


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


@dataclass
class _Row:
    request: Request
    stream: TextStream
    generator: torch.Generator | None
    logits: torch.Tensor


class Scheduler:
    """Owns ``model``: call :meth:`submit` from any thread; a daemon thread decodes (see the module doc)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int,
        max_queue: int,
        eos_ids: list[int],
        device: torch.device,
    ) -> None:
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.max_batch, self.max_queue = max_batch, max_queue
        self.eos = set(eos_ids)
        self.batch = DecodeBatch(model, max_batch)
        self._waiting: collections.deque[Request] = collections.deque()
        self._rows: list[_Row] = []
        self._wake = threading.Condition()
        self._closing = False
        self._in_flight = 0  # waiting + decoding, counted under the lock (rows are the thread's own)
        self.steps = 0  # batched forwards so far (the tests read it)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="tlm-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    def submit(self, request: Request) -> None:
        """Queue ``request``; raises :class:`QueueFull` or :class:`Closed` instead of queueing without bound."""
        with self._wake:
            if self._closing:
                raise Closed("the server is shutting down")
            if self._in_flight >= self.max_batch + self.max_queue:
                raise QueueFull(
                    f"{self.max_batch} requests are decoding and {self.max_queue} waiting already (--max-batch, "
                    "--max-queue)"
                )
            self._in_flight += 1
            self._waiting.append(request)
            self._wake.notify()

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

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while self._next_step():
                    pass
        except BaseException as err:  # the model failed: every request in flight ends, and the server says so
            self.error = err
            for request in [*self._waiting, *(row.request for row in self._rows)]:
                request.emit("", "error")
            raise

    def _next_step(self) -> bool:
        with self._wake:
            while not self._rows and not self._waiting:
                if self._closing:
                    return False
                self._wake.wait()
            joining: list[Request] = []
            while self._waiting and len(self._rows) + len(joining) < self.max_batch:
                joining.append(self._waiting.popleft())
        for request in joining:
            if request.cancelled.is_set():
                self._left(1)
                continue
            generator = None
            if request.temperature > 0:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(request.seed if request.seed is not None else int(time.time_ns()) % 2**63)
            logits = self.batch.add(torch.tensor(request.prompt, device=self.device))
            self._rows.append(_Row(request, TextStream(self.tokenizer, request.stop), generator, logits))
        if not self._rows:
            return True
        tokens = [
            sample_next_token(row.logits, temperature=row.request.temperature, top_p=row.request.top_p,
                              generator=row.generator)
            for row in self._rows
        ]  # fmt: skip
        # The one read of the step back to the host: the text needs the ids.
        for row, token_id in zip(self._rows, torch.stack(tokens).tolist(), strict=True):
            request = row.request
            request.completion_tokens += 1
            if token_id in self.eos:
                request.emit(row.stream.close(), "stop")
                request.cancelled.set()
                continue
            text, stopped = row.stream.add(token_id)
            if stopped:
                request.emit(text, "stop")
                request.cancelled.set()
            elif request.completion_tokens >= request.max_tokens:
                request.emit(text + row.stream.close(), "length")
                request.cancelled.set()
            elif text:
                request.emit(text, None)
        # Ended and cancelled rows leave before the forward; the last row takes each one's place.
        for r in reversed(range(len(self._rows))):
            if self._rows[r].request.cancelled.is_set():
                self.batch.remove(r)
                self._rows[r], tokens[r] = self._rows[-1], tokens[-1]
                self._rows.pop(), tokens.pop()
                self._left(1)
        if self._rows:
            logits = self.batch.step(torch.stack(tokens))
            for row, row_logits in zip(self._rows, logits.unbind(0), strict=True):
                row.logits = row_logits
            self.steps += 1
        return True
