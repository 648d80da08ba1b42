"""Read one version of a folder, every file confined to it.

A folder may be replaced while it is read (``tlm_core.atomic.replace_dir`` swaps a new one in): a
reader that opens ``folder/name`` path by path could take ``config.json`` from one export and the
weights from the next. :class:`Folder` opens the folder once and every file relative to that handle,
so every file comes from the one version that was there; :func:`read_consistently` starts again when
that version is retired before one of its files was opened (the ``read_dir_files`` rule of
``tlm_core.atomic``, for files too large to read whole into memory).

Names are plain file names: no separator, no ``..``, never absolute. A symlink is followed only to a
file inside the folder or, in the HF hub cache's layout (``<repo>/snapshots/<rev>/`` whose files link
to ``<repo>/blobs/``), into that repository's ``blobs`` folder; anything else is refused by name, and
only regular files are read (never a FIFO or a device, which could block or never end).
"""

import errno
import io
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tlm_core.atomic import is_current
from tlm_core.checks import short_repr

T = TypeVar("T")

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO for reading would wait for a writer; the file-type check comes after the open.
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_ATTEMPTS = 100


class Retired(Exception):
    """The folder was replaced after it was opened and before one of its files was: read again."""


def check_name(name: object, what: str) -> str:
    """``name`` if it is a plain file name (what an HF folder's index and files use)."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a file name (a string), got {type(name).__name__} ({short_repr(name)})")
    if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(
            f"{what} must be a file name inside the folder (no path separator, not '..'), got {short_repr(name)}"
        )
    return name


class Folder:
    """One open version of the folder ``path``; open its files with :meth:`open`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, _DIR_FLAGS)
        try:
            self.real = Path(os.path.realpath(path))
            if not is_current(self.fd, self.real):
                raise Retired  # replaced between the open and realpath
        except BaseException:
            os.close(self.fd)
            raise
        self.roots = [self.real]
        if self.real.parent.name == "snapshots":  # the HF hub cache: <repo>/snapshots/<rev> -> <repo>/blobs
            self.roots.append(self.real.parent.parent / "blobs")

    def __enter__(self) -> "Folder":
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def open(self, name: str) -> io.BufferedReader | None:
        """``name`` opened for reading, or None when the folder (still current) has no such file."""
        check_name(name, "a file name")
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            if self._retired():
                raise Retired from None
            return None
        except OSError as err:
            if err.errno != errno.ELOOP:  # O_NOFOLLOW's answer for a symlink
                raise
            fd = self._open_link(name)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{self.path / name} is not a regular file; an HF folder holds files only")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def read(self, name: str, limit: int) -> bytes | None:
        """The bytes of the small file ``name`` (at most ``limit``), or None when it is absent."""
        handle = self.open(name)
        if handle is None:
            return None
        with handle:
            data = handle.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"{self.path / name} is over {limit:,} bytes: too large for a config or index file")
        return data

    def _open_link(self, name: str) -> int:
        target = os.readlink(name, dir_fd=self.fd)
        resolved = Path(os.path.realpath(self.real / target))
        if not any(resolved.is_relative_to(root) for root in self.roots):
            raise ValueError(
                f"{self.path / name} is a symlink to {resolved}, outside the folder; tlm reads only files inside it"
            )
        try:
            return os.open(resolved, _FILE_FLAGS)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "a symlink to a missing file", str(self.path / name)) from None

    def _retired(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0 or not is_current(self.fd, self.path)


def read_consistently(path: Path, read: Callable[[Folder], T]) -> T:
    """``read(folder)`` on one version of the folder at ``path``, again on the new one if it was replaced."""
    for _ in range(_ATTEMPTS):
        try:
            with Folder(path) as folder:
                return read(folder)
        except Retired:
            continue
    raise OSError(errno.EBUSY, "the folder kept being replaced while it was read", str(path))  # pragma: no cover
