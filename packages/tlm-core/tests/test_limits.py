"""``time_limit``: a Python loop past its bound is stopped in its own thread, and nothing leaks past the block."""

import threading
import time

import pytest

from tlm_core.limits import TimeLimitExceeded, time_limit


def test_a_loop_past_the_bound_is_stopped_with_the_message():
    start = time.process_time()  # CPU seconds: a busy machine stretches the wall clock, not the loop's work
    with pytest.raises(TimeLimitExceeded, match="^too slow$"), time_limit(0.05, "too slow"):
        while True:
            pass
    assert time.process_time() - start < 2


def test_a_block_that_ends_first_is_untouched_and_nothing_arrives_after_it():
    with time_limit(0.05, "never") as limit:
        value = sum(range(1000))
    assert value == 499500 and not limit._fired
    time.sleep(0.1)  # the timer was cancelled: no interruption reaches this code
    for _ in range(100):  # many short blocks, each ending near its bound: none leaks an interruption out
        try:
            with time_limit(0.001, "edge"):
                deadline = time.perf_counter() + 0.001
                while time.perf_counter() < deadline:
                    pass
        except TimeLimitExceeded:
            pass
    time.sleep(0.01)
    sum(range(100_000))  # bytecode runs here: a leaked interruption would raise


def test_it_stops_the_thread_it_was_entered_in_only():
    outcome = {}

    def worker():
        try:
            with time_limit(0.05, "worker"):
                while True:
                    pass
        except TimeLimitExceeded as err:
            outcome["worker"] = str(err)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(5)
    assert outcome == {"worker": "worker"} and not thread.is_alive()


def test_the_bound_must_be_positive():
    with pytest.raises(ValueError, match="seconds must be > 0, got 0"):
        time_limit(0, "x")


def test_the_error_raised_may_be_another_kind():
    with pytest.raises(ValueError, match="^a template looped$"), time_limit(0.05, "a template looped", ValueError):
        while True:
            pass


def test_a_timer_that_fires_just_after_the_block_does_nothing_and_is_stopped():
    limit = time_limit(10, "late")
    with limit:
        pass
    limit._fire()  # the timer's call, as if it came between the block's end and its cancel: nothing must happen
    sum(range(100_000))  # bytecode runs here: an interruption requested after the block would raise
    assert not limit._fired
    limit._timer.join(2)  # cancelled at the block's end: the timer thread ends now, not in 10 s
    assert not limit._timer.is_alive()


def test_the_timer_never_holds_the_interpreter_at_exit():
    # threading's contract: the interpreter exits without waiting for daemon threads. A block still running in a
    # daemon worker when the program ends must not keep it alive until the limit's timer fires.
    before = set(threading.enumerate())
    with time_limit(60, "never reached"):
        started = [thread for thread in threading.enumerate() if thread not in before]
    assert started and all(thread.daemon for thread in started)
