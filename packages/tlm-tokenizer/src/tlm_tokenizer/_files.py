"""All-or-nothing writes: a fresh temporary name in the target's folder, fsync, one rename."""

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import BinaryIO


def _fsync_dir(folder: pathlib.Path) -> None:
    # The rename itself is only durable once the folder's entry is on disk (POSIX; a no-op elsewhere).
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a binary file that replaces ``path`` on a clean exit and vanishes on an error."""
    target = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def atomic_directory(path: str | os.PathLike, fill: Callable[[pathlib.Path], None]) -> None:
    """Build a directory with ``fill(tmp_dir)``, then move it to ``path`` in one rename.

    An existing ``path`` is first moved aside and deleted only after the new one is in place, so a
    reader sees the old complete directory or the new complete one, never a mixture.
    """
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        fill(tmp)
        for child in tmp.iterdir():
            with open(child, "rb") as handle:
                os.fsync(handle.fileno())
        if target.exists():
            if not target.is_dir():
                raise NotADirectoryError(f"path: expected a directory (or nothing), got an existing file {target}")
            old = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.replace(target, old / "previous")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(target.parent)
