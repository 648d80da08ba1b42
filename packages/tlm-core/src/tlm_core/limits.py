"""A time bound on Python work in the current thread: untrusted code (a chat template) that loops is stopped.

:class:`time_limit` arms a timer; when it fires while the block still runs, the thread gets a
:class:`TimeLimitExceeded` at its next bytecode (CPython's ``PyThreadState_SetAsyncExc``, the way a debugger
interrupts a thread). So the thread is freed, not abandoned. A single C call (a huge string product, a regex)
is interrupted only when it returns: bound the sizes such code can reach as well.
"""

import ctypes
import threading
from types import TracebackType

__all__ = ["TimeLimitExceeded", "time_limit"]


class TimeLimitExceeded(Exception):
    """The block ran past its :class:`time_limit`."""


def _raise_in(thread_id: int, kind: type[BaseException] | None) -> None:
    """Ask ``thread_id`` to raise ``kind`` at its next bytecode; ``None`` withdraws a request not yet delivered."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), None if kind is None else ctypes.py_object(kind)
    )


class time_limit:
    """``with time_limit(seconds, message):``: the block raises ``error(message)`` (:class:`TimeLimitExceeded` by
    default) once it has run for ``seconds``; a block that ends first is untouched, and no interruption reaches
    code after the block."""

    def __init__(self, seconds: float, message: str, error: type[Exception] = TimeLimitExceeded) -> None:
        if not seconds > 0:
            raise ValueError(f"seconds must be > 0, got {seconds!r}")
        self.seconds, self.message, self.error = seconds, message, error
        self._lock = threading.Lock()
        self._running = False
        self._fired = False

    def _fire(self) -> None:
        with self._lock:
            if self._running:
                self._fired = True
                _raise_in(self._thread, TimeLimitExceeded)

    def __enter__(self) -> "time_limit":
        self._thread = threading.get_ident()
        self._running, self._fired = True, False
        self._timer = threading.Timer(self.seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        while True:  # the interruption may arrive here, before the lock is held: then it has fired, and we go on
            try:
                with self._lock:
                    self._running = False
                    if self._fired:
                        _raise_in(self._thread, None)  # one still pending must not reach the caller's code
                break
            except TimeLimitExceeded:
                self._fired = True
        self._timer.cancel()
        if self._fired:
            raise self.error(self.message) from None
