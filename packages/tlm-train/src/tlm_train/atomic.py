"""All-or-nothing file writes: a fresh temporary name in the same folder, fsync, one rename."""

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> Path:
    """Call ``write(file)`` on a new temporary file beside ``path``, then rename it to ``path``.

    If anything fails (the writer, a full disk, a permission error) the temporary file is removed
    and ``path`` keeps its previous content; readers never see a partial file under ``path``.
    ``mkstemp`` creates the temporary name exclusively, so a planted file or symlink there is never
    followed or overwritten.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write(path, lambda file: file.write(text.encode("utf-8")))


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the folder's entry is on disk (POSIX; a no-op elsewhere).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
