"""How many CPU threads a command should compute with, on a machine that other processes may be using.

PyTorch starts one intra-op thread per core. On a machine whose cores are busy with other work, those
threads wait for each other at every parallel region, and a run can go many times slower than on one
thread. :func:`fit_threads` keeps the threads to the cores the 1-minute load average leaves free, unless
``OMP_NUM_THREADS`` says otherwise (the user's choice always wins, and is never second-guessed).
Standard library only: the caller applies the count (``torch.set_num_threads``).
"""

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

#: The environment variable a user sets to choose the threads (PyTorch's OpenMP reads it at start).
THREADS_VARIABLE = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    """The threads to use, and a one-line note for the user when the count was lowered (else None)."""

    threads: int
    note: str | None = None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)  # pragma: no cover - macOS and Windows


def load_average() -> float | None:
    """The 1-minute load average, or None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - Windows
        return None


def fit_threads(
    current: int,
    *,
    cpus: int | None = None,
    load: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> ThreadChoice:
    """The intra-op threads for a process that now has ``current`` of them.

    With ``OMP_NUM_THREADS`` set in ``environ`` (default ``os.environ``), ``current`` is kept. Otherwise the
    busy cores are the 1-minute ``load`` (default :func:`load_average`) rounded to the nearest whole core, and
    the threads are the ``cpus`` (default :func:`usable_cpus`) left free, at least 1 and at most ``current``;
    when that is below ``current``, :attr:`ThreadChoice.note` says so in one line and names what to set.
    The load is read at start, before this process has done any work, so it counts the others' only.
    """
    for name, value in (("current", current), ("cpus", cpus)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if load is not None and (not isinstance(load, (int, float)) or isinstance(load, bool) or not load >= 0):
        raise ValueError(f"load must be a non-negative number, got {load!r}")
    environ = os.environ if environ is None else environ
    if environ.get(THREADS_VARIABLE, "").strip():
        return ThreadChoice(current)
    cpus = usable_cpus() if cpus is None else cpus
    load = load_average() if load is None else load
    if load is None or not math.isfinite(load):
        return ThreadChoice(current)
    free = max(1, min(current, int(cpus - load + 0.5)))
    if free >= current:
        return ThreadChoice(current)
    return ThreadChoice(
        free,
        f"the machine is busy (load {load:.1f} on {cpus} CPUs): computing on {free} thread"
        f"{'s' if free > 1 else ''} instead of {current}; set {THREADS_VARIABLE} to choose (e.g. "
        f"{THREADS_VARIABLE}={free})",
    )
