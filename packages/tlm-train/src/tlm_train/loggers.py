"""Where a run's numbers go: one small interface, backends chosen by name (torchtune's ``metric_logging``,
litgpt's ``choose_logger``).

A record is a flat dict with ``step`` and ``time_s`` (seconds since training began, a resumed run
continuing the count) and whatever was measured: ``train_loss``, ``val_loss``, ``lr``, ... or an
``event``. ``metrics.jsonl`` is always written, and is the record every tlm command reads; TensorBoard
(``tensorboard=True``, ``tlm train --tensorboard``) writes event files under ``RUN/tensorboard/`` through
``torch.utils.tensorboard`` (the optional ``tlm-train[tensorboard]``).
"""

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tlm_train.metrics import MetricsLog
from tlm_train.run_dir import METRICS_NAME

#: The folder of TensorBoard's event files inside a run folder (``tensorboard --logdir RUN``).
TENSORBOARD_DIR = "tensorboard"

#: TensorBoard tags of the numbers a record may hold; anything else (events, settings) is not a scalar.
TENSORBOARD_TAGS = {
    "train_loss": "loss/train",
    "val_loss": "loss/val",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens": "train/tokens",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
}


@runtime_checkable
class MetricLogger(Protocol):
    """A backend: takes each record as it is made, and is closed once at the end of the run."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """One JSON line per record in ``RUN/metrics.jsonl`` (:class:`~tlm_train.MetricsLog`)."""

    def __init__(self, run_dir: Path, *, start_step: int = 0) -> None:
        self.metrics = MetricsLog(run_dir / METRICS_NAME)

    def log(self, record: dict[str, Any]) -> None:
        self.metrics.append(record)

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Scalars in TensorBoard event files under ``RUN/tensorboard/``, one per number of a record at its step.

    A run resumed at step N opens its writer with ``purge_step=N + 1``: TensorBoard's readers then drop
    what the interrupted process had logged past the resumed step, as ``metrics.jsonl`` is truncated.
    """

    def __init__(self, run_dir: Path, *, start_step: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package itself
            raise ImportError(
                "--tensorboard needs the tensorboard package: pip install 'tlm-train[tensorboard]'"
            ) from None
        self.log_dir = run_dir / TENSORBOARD_DIR
        self.writer = SummaryWriter(
            str(self.log_dir), purge_step=start_step + 1 if start_step > 0 else None, flush_secs=10
        )

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, tag in TENSORBOARD_TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


#: The backends by name; ``jsonl`` is always among those a run opens.
LOGGERS: dict[str, Callable[..., MetricLogger]] = {"jsonl": JsonlLogger, "tensorboard": TensorBoardLogger}


class Loggers:
    """Every chosen backend behind the one interface: :meth:`log` gives each the record."""

    def __init__(self, backends: Sequence[MetricLogger] = ()) -> None:
        self.backends = list(backends)

    def log(self, record: dict[str, Any]) -> None:
        for backend in self.backends:
            backend.log(record)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


def choose_loggers(names: Sequence[str], run_dir: str | os.PathLike[str], *, start_step: int = 0) -> Loggers:
    """The backends ``names`` (each a key of :data:`LOGGERS`) for ``run_dir``, ``jsonl`` first and always.

    ``start_step`` is the step the run continues from (0 for a new run). An unknown name is a
    ``ValueError`` naming the known ones; a backend whose library is missing raises ``ImportError``.
    """
    unknown = sorted(set(names) - set(LOGGERS))
    if unknown:
        raise ValueError(f"unknown logger(s) {unknown}; expected some of {sorted(LOGGERS)}")
    chosen = ["jsonl", *dict.fromkeys(name for name in names if name != "jsonl")]
    return Loggers([LOGGERS[name](Path(run_dir), start_step=start_step) for name in chosen])
