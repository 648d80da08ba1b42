"""The run folder: one place that every command reads and ``tlm train`` writes (ARCHITECTURE.md). Its names
and what inference reads of it are ``tlm_artifacts.layout``'s (:class:`~tlm_artifacts.layout.RunFolder`);
:class:`RunDir` adds what training needs: the lock, ``train.toml`` as a ``TrainConfig``, the checks.

```
RUN/train.toml  tokenizer/  data/{train.npy,val.npy,info.json}  metrics.jsonl  loss.png
    checkpoints/step_N/{model.safetensors,train_state.pt}  .lock
```

:class:`RunDir` names the paths and reads them; :meth:`RunDir.lock` keeps a second process from
training into the same folder (``flock``: the kernel frees it when the holder dies, so a stale lock
from a killed run never blocks the next one).
"""

import contextlib
import dataclasses
import errno
import json
import os
import re
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tlm_artifacts.layout import CHECKPOINT_DIR, DATA_DIR, METRICS_NAME, TOKENIZER_DIR, RunFolder
from tlm_core.atomic import atomic_write
from tlm_train.checkpoint import CheckpointManager
from tlm_train.config import CONFIG_NAME, FIXED_ON_RESUME, TrainConfig

__all__ = [
    "CHECKPOINT_DIR", "DATA_DIR", "LOCK_NAME", "METRICS_NAME", "PLOT_NAME", "TENSORBOARD_DIR", "TOKENIZER_DIR",
    "RunDir", "RunInUseError", "RunLock", "check_apart",
]  # fmt: skip

PLOT_NAME = "loss.png"
LOCK_NAME = ".lock"
#: The folder of TensorBoard's event files inside a run folder (``tensorboard --logdir RUN``).
TENSORBOARD_DIR = "tensorboard"
_EARLIER_STEP = re.compile(r"step_(\d+)\.pt")  # tlm-train 0.1's checkpoint files


class RunInUseError(RuntimeError):
    """Another live process holds the run folder's lock."""


def check_apart(out_dir: str | os.PathLike[str], inputs: dict[str, list[str]]) -> None:
    """Refuse a run folder that is, lies inside, or holds one of ``inputs`` (flag -> paths it reads):
    the run writes ``train.toml``, ``checkpoints/`` and the rest into it, so it would write into what it
    reads. Paths are compared after resolving symlinks and ``..``."""
    out = Path(out_dir).resolve()
    for name, paths in inputs.items():
        for given in paths:
            source = Path(given).resolve()
            if out == source:
                how = "is"
            elif source in out.parents:
                how = "lies inside"
            elif out in source.parents:
                how = "holds"
            else:
                continue
            raise ValueError(
                f"--out-dir {out_dir} {how} {name} {given}: a run writes into its folder, so it must not overlap "
                "what it reads; choose another --out-dir"
            )


class RunDir(RunFolder):
    """The paths of a run folder and the readers of what is in it, with what training writes and checks."""

    plot_path = property(lambda self: self.path / PLOT_NAME)
    lock_path = property(lambda self: self.path / LOCK_NAME)

    def check_layout(self) -> None:
        """Refuse a run folder of tlm-train 0.1's layout (``checkpoints/step_N.pt`` files, no step folders):
        this version cannot read those checkpoints, and must neither restart over them nor resume from step 0."""
        try:
            names = os.listdir(self.checkpoints_dir)
        except (FileNotFoundError, NotADirectoryError):
            return
        earlier = sorted((int(m.group(1)), name) for name in names if (m := _EARLIER_STEP.fullmatch(name)))
        if earlier:
            raise ValueError(
                f"{self.path} is a tlm-train 0.1 run ({len(earlier)} checkpoints/step_N.pt files, the newest "
                f"{earlier[-1][1]}), which this version cannot read, so it is neither resumed nor overwritten: "
                "continue it with tlm-train 0.1 (pip install 'tlm-train<0.2'), or train into another --out-dir"
            )

    def check_links(self) -> None:
        """Refuse a symlink at ``RUN/checkpoints`` or ``RUN/tensorboard``: step folders or event files would be
        written wherever it points. (Every file the run creates is replaced by rename or opened with
        ``O_NOFOLLOW``, the lock too; see ARCHITECTURE.md.)"""
        for folder in (self.checkpoints_dir, self.path / TENSORBOARD_DIR):
            if folder.is_symlink():
                raise ValueError(
                    f"{folder} is a symbolic link: tlm train never writes through one; remove it (to keep "
                    f"{folder.name} on another disk, put the whole --out-dir there)"
                )

    def checkpoints(self, keep: int = 2) -> CheckpointManager:
        return CheckpointManager(self.checkpoints_dir, keep=keep)

    def read_config(self, **overrides: Any) -> TrainConfig:
        if not self.config_path.exists():  # a FIFO or folder there: from_toml says which
            raise FileNotFoundError(
                errno.ENOENT, f"no {CONFIG_NAME} here, so it is not a tlm train run", str(self.path)
            )
        return TrainConfig.from_toml(self.config_path, **overrides)

    def write_config(self, config: TrainConfig) -> None:
        atomic_write(self.config_path, config.to_toml())

    @contextlib.contextmanager
    def lock(self) -> Iterator["RunLock"]:
        """Hold the run folder's lock for the ``with`` block; :class:`RunInUseError` when a live process has it."""
        self.path.mkdir(parents=True, exist_ok=True)
        held = RunLock(self.lock_path)
        try:
            yield held
        finally:
            held.release()


class RunLock:
    """An exclusive ``flock`` on ``RUN/.lock``. The file keeps who holds it (pid, host), for the message a
    second process gets; the kernel releases the lock when the holder exits, however it exits."""

    def __init__(self, path: Path, *, command: str = "tlm train") -> None:
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            self._fd: int | None = os.open(path, flags, 0o666)
        except OSError as err:
            if err.errno == errno.ELOOP or path.is_symlink():
                raise ValueError(f"{path} is a symbolic link: {command} never follows one; remove it") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(self._fd).st_mode):
                raise ValueError(f"{path} is not a regular file: remove it")
            _flock(self._fd)
        except ValueError:
            self.release()
            raise
        except BlockingIOError:
            holder = _read_holder(self._fd)
            self.release()
            raise RunInUseError(
                f"{path.parent} is in use by another {command} ({holder}); wait for it to finish, or choose another "
                "--out-dir"
            ) from None

    def record(self) -> None:
        """Write this process into the lock file (after the run is known to go ahead)."""
        assert self._fd is not None
        text = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text, 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _flock(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks here; one writer is the user's job
        return
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _read_holder(fd: int) -> str:
    try:
        data = json.loads(os.pread(fd, 200, 0) or b"{}")
        return f"pid {data['pid']} on {data['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not recorded itself yet"


def resume_config(planned: TrainConfig) -> TrainConfig:
    """What the run in ``planned.out_dir`` resumes with: its own ``train.toml`` with the planned settings that a
    resume may change over it (steps, learning rate, intervals, ...), as ``tlm train --resume RUN --steps N``
    does. The others (model, data, tokenizer, seed: :data:`FIXED_ON_RESUME`) stay the run's: re-applied, a
    vocabulary the tokenizer filled to fewer tokens than --vocab-size would read as a changed one."""
    fixed = {*FIXED_ON_RESUME, "model", "preset", "out_dir"}
    changeable = {f.name: getattr(planned, f.name) for f in dataclasses.fields(TrainConfig) if f.name not in fixed}
    return RunDir(planned.out_dir).read_config(out_dir=planned.out_dir, **changeable)
