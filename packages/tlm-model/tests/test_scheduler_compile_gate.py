"""The background warm-up (``Scheduler.compile_in_background``) waits for a quiet moment: the compiler takes the
CPU and the GIL, so compiling while a burst of requests decodes slowed the burst several-fold on a 2-core CPU
(docs/benchmarks.md). It starts once the eager engine has run no step for ``compile_quiet_s`` (before its first forward
``compile_start_quiet_s``: a server just started meets its first clients at once), or at ``compile_patience_s``
after it was asked for when the server is never quiet."""

import threading
import time

import pytest
import torch
from scheduler_parts import byte_model, byte_tokenizer


class _Busy:
    """Clients that keep the scheduler stepping until ``stop``: two, each sending one greedy request after another,
    so that while one client is between its requests (its thread waking, submitting) the other's row still steps:
    the engine is never quiet for a moment that depends on how fast a busy machine wakes a thread."""

    def __init__(self, scheduler) -> None:
        from tlm_model.scheduler import Request

        self.stop, self._ends = threading.Event(), []

        def client() -> None:
            while not self.stop.is_set():
                done = threading.Event()

                def emit(piece, done=done):
                    if piece.finish_reason is not None:
                        done.set()

                scheduler.submit(Request(prompt=[97], max_tokens=40, emit=emit, temperature=0.0))
                assert done.wait(60)
            self._ends.append(time.monotonic())

        self.threads = [threading.Thread(target=client, daemon=True) for _ in range(2)]
        for thread in self.threads:
            thread.start()

    def end(self) -> float:
        """Stop the clients; when the last of their requests ended."""
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        assert len(self._ends) == len(self.threads), "a client did not end"
        return max(self._ends)


@pytest.fixture
def scheduler(monkeypatch):
    """A scheduler whose compiler records when it was called, and fails (the eager engine serves on)."""
    import tlm_model
    from tlm_model.scheduler import Scheduler

    called: list[float] = []

    def compile_for_inference(model):
        called.append(time.monotonic())
        raise RuntimeError("no compiler in this test")

    monkeypatch.setattr(tlm_model, "compile_for_inference", compile_for_inference)
    lines: list[str] = []
    scheduler = Scheduler(byte_model(), byte_tokenizer(), max_batch=2, max_queue=2, eos_ids=[],
                          device=torch.device("cpu"), log=lines.append)  # fmt: skip
    scheduler.called, scheduler.lines = called, lines
    yield scheduler
    scheduler.close(timeout=10)


def _wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_warm_up_compiles_only_once_the_engine_is_quiet(scheduler):
    scheduler.compile_quiet_s, scheduler.compile_start_quiet_s, scheduler.compile_patience_s = 0.3, 0.3, 60.0
    busy = _Busy(scheduler)
    _wait_for(lambda: scheduler.steps > 0, 30)
    scheduler.compile_in_background()
    time.sleep(1.5)
    assert scheduler.called == [] and scheduler.steps > 0  # still serving, not compiling
    ended = busy.end()
    _wait_for(lambda: scheduler.called, 30)
    assert len(scheduler.called) == 1 and scheduler.called[0] >= ended
    _wait_for(lambda: scheduler.engine_status().get("warm_up", {}).get("error"), 30)
    assert scheduler.engine_status()["engine"] == "eager"
    assert "no compiler in this test" in scheduler.engine_status()["warm_up"]["error"]


def test_a_server_never_quiet_still_compiles_after_the_patience(scheduler):
    scheduler.compile_quiet_s, scheduler.compile_patience_s = 0.3, 0.8
    busy = _Busy(scheduler)
    _wait_for(lambda: scheduler.steps > 0, 30)
    started = time.monotonic()
    scheduler.compile_in_background()
    _wait_for(lambda: scheduler.called, 30)
    ended = busy.end()
    assert len(scheduler.called) == 1 and started + 0.8 <= scheduler.called[0] < ended


def test_the_first_compiling_forward_waits_the_longer_start_quiet(scheduler):
    # An idle server just started: the compiler waits compile_start_quiet_s (the first clients' burst would come
    # now), not the shorter compile_quiet_s that gates the later forwards.
    scheduler.compile_quiet_s, scheduler.compile_start_quiet_s, scheduler.compile_patience_s = 0.01, 0.4, 60.0
    started = time.monotonic()
    scheduler.compile_in_background()
    _wait_for(lambda: scheduler.called, 30)
    assert len(scheduler.called) == 1 and scheduler.called[0] >= started + 0.4
