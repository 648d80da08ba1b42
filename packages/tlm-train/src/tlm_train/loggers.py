"""Where a run's numbers go: one small interface, backends chosen by name (torchtune's ``metric_logging``,
litgpt's ``choose_logger``).

A record is a flat dict with ``step`` and ``time_s`` (seconds since training began, a resumed run
continuing the count) and whatever was measured: ``train_loss``, ``val_loss``, ``lr``, ... or an
``event``. ``metrics.jsonl`` is always written, and is the record every tlm command reads; W&B (``wandb=True``,
``tlm train --wandb``, the optional ``tlm-train[wandb]``) gets the scalars TensorBoard gets; TensorBoard
(``tensorboard=True``, ``tlm train --tensorboard``) writes event files under ``RUN/tensorboard/``: the
records are TensorBoard's own (its ``RecordWriter``, torch's ``scalar`` summaries), the file is this
module's, created with ``O_EXCL | O_NOFOLLOW`` inside a folder opened with ``O_NOFOLLOW`` (the optional
``tlm-train[tensorboard]``). Each record is written and flushed when it is logged, so a backend's failure
(a full disk, a folder removed) is raised by :meth:`Loggers.log` as a :class:`LoggerError`, at the step it
happened.
"""

import errno
import itertools
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tlm_train.metrics import MetricsLog
from tlm_train.run_dir import METRICS_NAME, TENSORBOARD_DIR

#: TensorBoard tags of the numbers a record may hold; anything else (events, settings) is not a scalar.
TENSORBOARD_TAGS = {
    "train_loss": "loss/train",
    "val_loss": "loss/val",
    "val_bpb": "loss/val_bits_per_byte",
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
    """Scalars in a TensorBoard event file under ``RUN/tensorboard/``, one per number of a record at its step.

    A run resumed at step N starts its file as torch's ``SummaryWriter(purge_step=N + 1)`` does: TensorBoard's
    readers then drop what the interrupted process had logged past the resumed step, as ``metrics.jsonl`` is
    truncated. ``RUN/tensorboard`` is made here and never followed when it is a symbolic link (ValueError).
    """

    def __init__(self, run_dir: Path, *, start_step: int = 0) -> None:
        try:
            import torch.utils.tensorboard  # noqa: F401 - torch's check that the tensorboard package is there
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog
            from tensorboard.summary.writer.record_writer import RecordWriter
            from torch.utils.tensorboard.summary import scalar
        except ImportError:  # torch's summaries need the tensorboard package itself
            raise ImportError(
                "--tensorboard needs the tensorboard package: pip install 'tlm-train[tensorboard]'"
            ) from None
        self._event, self._scalar = Event, scalar
        self.log_dir = run_dir / TENSORBOARD_DIR
        # tensorboard's own file name: time, host, process, and a count within the process.
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILES)}"
        self.path = self.log_dir / name
        self._file = _create_in(self.log_dir, name)
        self._writer = RecordWriter(self._file)
        try:
            self._write(Event(file_version="brain.Event:2"))
            if start_step > 0:
                self._write(Event(step=start_step + 1, file_version="brain.Event:2"))
                self._write(Event(step=start_step + 1, session_log=SessionLog(status=SessionLog.START)))
            self._file.flush()
        except BaseException:
            self._file.close()
            raise

    def _write(self, event: Any) -> None:
        event.wall_time = time.time()
        self._writer.write(event.SerializeToString())

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, tag in TENSORBOARD_TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._write(self._event(step=int(step), summary=self._scalar(tag, value)))
        self._file.flush()
        if os.fstat(self._file.fileno()).st_nlink == 0:  # writes to a removed file succeed, and are lost
            raise FileNotFoundError(errno.ENOENT, "the event file was removed while the run wrote it", str(self.path))

    def close(self) -> None:
        self._file.close()


_FILES = itertools.count()


class WandbLogger:
    """The same scalars as :class:`TensorBoardLogger`, under the same tags, in a Weights & Biases run, with the run's
    settings (``train.toml``'s, as ``config``) as its config (the optional ``tlm-train[wandb]``).

    The W&B project is ``WANDB_PROJECT`` (default ``tlm``), the run's name the run folder's, its files under
    ``RUN/wandb/``; everything else is the ``wandb`` library's own environment: ``WANDB_MODE=offline`` logs with no
    account or network (``wandb sync RUN/wandb/offline-run-*`` uploads it later). Each process is a W&B run of its
    own: a run resumed at step N logs from step N + 1 in a new W&B run in the same group (the run folder's name),
    since W&B's steps only grow and the interrupted process may have logged past N. W&B's service writes the run's
    file in the background: it is complete once that service stops (at the process's exit, or ``wandb.teardown()``).
    """

    def __init__(self, run_dir: Path, *, start_step: int = 0, config: dict[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError("--wandb needs the wandb package: pip install 'tlm-train[wandb]'") from None
        folder = run_dir / "wandb"
        folder.mkdir(exist_ok=True)
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "tlm"),
                name=run_dir.resolve().name,
                group=run_dir.resolve().name,
                job_type="resume" if start_step else "train",
                dir=str(run_dir),
                config=config or {},
                settings=wandb.Settings(console="off"),  # the run's log lines are its own; W&B gets the numbers
                reinit="create_new",
            )
        except wandb.errors.Error as err:  # no API key, a refused login, an unknown entity: the user's setup
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ValueError(f"--wandb: W&B could not start a run: {first} (WANDB_MODE=offline logs with no "
                             "account)") from None  # fmt: skip

    def log(self, record: dict[str, Any]) -> None:
        values = {}
        for key, tag in TENSORBOARD_TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[tag] = value
        if values:
            self.run.log(values, step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


def _create_in(folder: Path, name: str) -> Any:
    """A new file ``name`` in ``folder`` (made if missing), open for binary writing: the folder is opened with
    ``O_NOFOLLOW`` and the file created in it with ``O_EXCL | O_NOFOLLOW``, so no symlink planted at either
    is followed."""
    try:
        os.mkdir(folder, 0o777)
    except FileExistsError:
        pass
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    try:
        dir_fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow)
    except OSError:
        if folder.is_symlink():
            raise ValueError(f"{folder} is a symbolic link: tlm train never writes through one; remove it") from None
        raise
    try:  # O_DIRECTORY refused anything but a folder above
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | nofollow | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(name, flags, 0o666, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    return os.fdopen(fd, "wb")


#: The backends by name; ``jsonl`` is always among those a run opens.
LOGGERS: dict[str, Callable[..., MetricLogger]] = {
    "jsonl": JsonlLogger,
    "tensorboard": TensorBoardLogger,
    "wandb": WandbLogger,
}


class LoggerError(RuntimeError):
    """A backend failed to record (a full disk, a read-only or vanished folder): ``name`` and the ``error``."""

    def __init__(self, name: str, error: BaseException) -> None:
        first = str(error).splitlines()[0] if str(error) else ""
        super().__init__(f"the {name} logger failed: {type(error).__name__}: {first}")
        self.name, self.error = name, error


class Loggers:
    """Every chosen backend behind the one interface: :meth:`log` gives each the record.

    A backend that raises is closed and dropped, then :meth:`log` raises :class:`LoggerError` naming it, once;
    the others go on being given records."""

    def __init__(self, backends: Sequence[MetricLogger] = (), names: Sequence[str] | None = None) -> None:
        self.backends = list(backends)
        self.names = list(names) if names is not None else [type(b).__name__ for b in self.backends]

    def log(self, record: dict[str, Any]) -> None:
        failed: LoggerError | None = None
        kept = []
        for name, backend in zip(self.names, self.backends, strict=True):
            try:
                backend.log(record)
            except Exception as err:
                failed = failed or LoggerError(name, err)
                try:
                    backend.close()
                except Exception:  # its own failure is the one being reported
                    pass
            else:
                kept.append((name, backend))
        if failed is not None:
            self.names, self.backends = [n for n, _ in kept], [b for _, b in kept]
            raise failed

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


def choose_loggers(
    names: Sequence[str],
    run_dir: str | os.PathLike[str],
    *,
    start_step: int = 0,
    config: dict[str, Any] | None = None,
) -> Loggers:
    """The backends ``names`` (each a key of :data:`LOGGERS`) for ``run_dir``, ``jsonl`` first and always.

    ``start_step`` is the step the run continues from (0 for a new run); ``config``, the run's settings, goes to
    the backends that record one (W&B). An unknown name is a ``ValueError`` naming the known ones; a backend
    whose library is missing raises ``ImportError``.
    """
    unknown = sorted(set(names) - set(LOGGERS))
    if unknown:
        raise ValueError(f"unknown logger(s) {unknown}; expected some of {sorted(LOGGERS)}")
    chosen = ["jsonl", *dict.fromkeys(name for name in names if name != "jsonl")]
    backends: list[MetricLogger] = []
    try:
        for name in chosen:
            extra = {"config": config} if name == "wandb" else {}
            backends.append(LOGGERS[name](Path(run_dir), start_step=start_step, **extra))
    except BaseException:
        for backend in backends:  # the ones opened before the failure
            backend.close()
        raise
    return Loggers(backends, chosen)
