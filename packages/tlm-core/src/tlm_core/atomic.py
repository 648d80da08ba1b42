"""All-or-nothing writes of files and folders, and consistent reads of folders written that way.

A file is written under a fresh temporary name in its own folder (created with ``O_EXCL |
O_NOFOLLOW``, so nothing planted there is followed), fsynced, renamed over the target in one
``os.replace`` and the folder fsynced: a reader, or a process killed at any moment, sees the old file
or the new one, never a mix. A folder is built complete under a temporary name and then put in place
in one step: on Linux ``renameat2(RENAME_EXCHANGE)`` swaps it with the old folder atomically, so a
reader never finds the path missing; elsewhere the old folder is moved aside first (a reader may then
find it missing for an instant, never half-written). New files get mode ``0o666`` and folders
``0o777``, less the umask, as ``open()`` and ``mkdir`` give them.

Temporary names are ``.<name>.<pid>-<random>.tmp`` beside the target: :func:`remove_leftovers` deletes
those whose process is gone (a writer that was killed), never a live writer's.
"""

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "atomic_file",
    "atomic_path",
    "atomic_write",
    "check_input",
    "create_new",
    "fsync_dir",
    "is_current",
    "open_input",
    "read_dir_files",
    "read_input",
    "remove_leftovers",
    "replace_dir",
    "temp_path",
]

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_TEMP = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)-[0-9a-f]{16}\.(?:tmp|old)")

#: Test seam: called with the name of each step of :func:`replace_dir` as it completes, so that tests
#: can kill the process or raise there. Steps: "filled", "swapped", "cleaned".
after_step: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if after_step is not None:
        after_step(name)


def temp_path(target: str | os.PathLike[str], kind: str = "tmp") -> Path:
    """A fresh name beside ``target`` for a temporary file or folder: ``.<name>.<pid>-<random>.<kind>``."""
    target = Path(target)
    return target.parent / f".{target.name}.{os.getpid()}-{secrets.token_hex(8)}.{kind}"


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the entries of ``directory`` (a rename into it) durable; a no-op where folders cannot be synced."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename itself is still atomic
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file that replaces ``path`` when the ``with`` block ends cleanly and vanishes on an error."""
    with _temporary(path) as (_, handle):
        yield handle


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh temporary path beside ``path``, for a library that writes a file by its name (a GGUF writer, say):
    when the ``with`` block ends cleanly that file is fsynced and renamed over ``path``, as :func:`atomic_file`
    does; on an error it is removed and ``path`` keeps what it held. The file is created empty first (``O_EXCL |
    O_NOFOLLOW``) and must still be that file at the end: one the library swapped in under the name is refused."""
    with _temporary(path) as (tmp, handle):
        yield tmp
        if not is_current(handle.fileno(), tmp):
            raise FileNotFoundError(
                errno.ENOENT, "the file was replaced or removed before it was put in place", str(tmp)
            )


@contextlib.contextmanager
def _temporary(path: str | os.PathLike[str]) -> Iterator[tuple[Path, BinaryIO]]:
    # The one implementation of "temporary file, fsync, rename over the target, fsync the folder".
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, "expected a file path, got a folder", str(target))
    while True:
        tmp = temp_path(target)
        try:
            fd = os.open(tmp, _CREATE, 0o666)
            break
        except FileExistsError:  # pragma: no cover - 64 random bits collided
            continue
    try:
        with os.fdopen(fd, "wb") as handle:
            yield tmp, handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)  # rename(2) replaces the entry itself: a symlink there is not followed
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def atomic_write(path: str | os.PathLike[str], data: bytes | str | Callable[[BinaryIO], object]) -> Path:
    """Replace ``path`` all-or-nothing with ``data``: bytes, text (written as UTF-8), or a function
    that writes into the binary file it is given. Returns the path."""
    with atomic_file(path) as handle:
        if isinstance(data, str):
            handle.write(data.encode("utf-8"))
        elif isinstance(data, (bytes, bytearray, memoryview)):
            handle.write(data)
        else:
            data(handle)
    return Path(path)


def create_new(path: str | os.PathLike[str]) -> BinaryIO:
    """A new file at ``path`` open for writing, created with ``O_EXCL | O_NOFOLLOW``: an existing file or a
    symlink planted there raises ``FileExistsError`` and is never followed or truncated. Name it with
    :func:`temp_path` for a scratch file that :func:`remove_leftovers` can clean up after a kill."""
    return os.fdopen(os.open(path, _CREATE, 0o666), "wb")


def _fsync_tree(folder: Path) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where that is unavailable."""
    import ctypes  # here: only a folder replacement needs it

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # the file system cannot exchange: fall back to two renames
    raise OSError(err, os.strerror(err), str(b))


def _remove(path: Path) -> None:
    """Delete a file, a symlink or a folder tree at ``path`` (never following a symlink)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def replace_dir(path: str | os.PathLike[str], fill: Callable[[Path], object]) -> Path:
    """Build a folder with ``fill(tmp_folder)`` and put it at ``path`` in place of whatever was there.

    The new folder is complete and fsynced before it appears; the old one (a folder, or a symlink,
    which is replaced and never followed) is removed after. A failure in ``fill`` leaves ``path``
    untouched. ``path`` must not be a file. Returns ``path``.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not target.is_symlink() and not target.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "expected a folder path (or nothing), got a file", str(target))
    tmp = temp_path(target)
    os.mkdir(tmp, 0o777)
    try:
        fill(tmp)
        _fsync_tree(tmp)
        _step("filled")
        for _ in range(100):  # another writer may be replacing the same folder: retry until one wins
            if not os.path.lexists(target):
                try:
                    os.rename(tmp, target)
                    break
                except OSError as err:
                    if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
                    continue  # someone else's folder arrived first: replace it below
            if _exchange(tmp, target):
                _step("swapped")
                _remove(tmp)  # now the old folder
                break
            old = temp_path(target, "old")
            try:
                os.rename(target, old)
            except FileNotFoundError:
                continue
            try:
                os.rename(tmp, target)
            except OSError:
                os.rename(old, target)  # put the old folder back rather than leave nothing
                raise
            _step("swapped")
            _remove(old)
            break
        else:  # pragma: no cover - 100 lost races in a row
            raise OSError(errno.EBUSY, "another process keeps replacing this folder", str(target))
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(target.parent)
    _step("cleaned")
    return target


def read_dir_files(
    path: str | os.PathLike[str], names: Collection[str], *, optional: Collection[str] = ()
) -> dict[str, bytes]:
    """The bytes of each of ``names`` (and of ``optional`` ones that exist) in the folder ``path``, all
    from one version of the folder even while :func:`replace_dir` replaces it: every file is opened
    relative to one open handle on the folder, and the read starts again if that folder is retired
    under it. A missing required file raises ``FileNotFoundError`` naming it, and one that is not a regular file
    (a FIFO, a device) ``ValueError``, without blocking on it."""
    folder = Path(path)
    for _ in range(100):
        try:
            dir_fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except NotADirectoryError:
            raise NotADirectoryError(errno.ENOTDIR, "expected a folder", str(folder)) from None
        try:
            found: dict[str, bytes] = {}
            retired = False
            for name in [*names, *optional]:
                try:  # not blocking: a FIFO planted under the name is refused below, never waited on
                    fd = os.open(name, os.O_RDONLY | _NONBLOCK | getattr(os, "O_NOFOLLOW", 0), dir_fd=dir_fd)
                except FileNotFoundError:
                    if os.stat(dir_fd).st_nlink == 0 or not is_current(dir_fd, folder):
                        retired = True  # replaced while we read: read the new folder instead
                        break
                    if name in optional:
                        continue
                    raise FileNotFoundError(errno.ENOENT, "missing from the folder", str(folder / name)) from None
                with os.fdopen(fd, "rb") as handle:
                    if not stat.S_ISREG(mode := os.fstat(fd).st_mode):
                        raise ValueError(f"{folder / name}: {_kind(mode)}, expected a regular file")
                    if _NONBLOCK:
                        os.set_blocking(fd, True)
                    found[name] = handle.read()
            if not retired:
                return found
        finally:
            os.close(dir_fd)
    raise OSError(errno.EBUSY, "the folder kept changing while it was read", str(folder))  # pragma: no cover


def is_current(fd: int, path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` still names the file or folder open as ``fd`` (False once it was replaced or removed)."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except FileNotFoundError:
        return False


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_input(path: str | os.PathLike[str], what: str) -> BinaryIO:
    """``path`` open for reading, refused unless it is a regular file: a folder, a device (``/dev/zero``), a
    FIFO or a socket raises ``ValueError`` naming ``what`` (a flag such as ``--data``) and the path, and a
    missing file ``FileNotFoundError``. The check is made on the open handle itself (``fstat``), and that
    handle is what the caller reads, so a file swapped for a FIFO or device after the check is never read. The
    open does not block on a FIFO (``O_NONBLOCK``, cleared again for the regular file)."""
    nonblock = getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, os.O_RDONLY | nonblock | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {os.fspath(path)}: no such file") from None
    except IsADirectoryError:  # pragma: no cover - platforms where opening a folder fails
        raise ValueError(f"{what} {os.fspath(path)}: a folder, expected a file") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{what} {os.fspath(path)}: {_kind(mode)}, expected a regular file")
        if nonblock:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_input(path: str | os.PathLike[str], what: str, *, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path``, read through :func:`open_input` (a FIFO, device or folder raises
    ``ValueError`` naming ``what`` and the path; a missing file ``FileNotFoundError``). With ``limit``, a file
    over that many bytes raises ``ValueError`` instead of being read whole."""
    with open_input(path, what) as handle:
        data = handle.read() if limit is None else handle.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise ValueError(f"{what} {os.fspath(path)}: over {limit:,} bytes, too large for what it should hold")
    return data


def check_input(path: str | os.PathLike[str], what: str) -> None:
    """Raise as :func:`open_input` would for ``path`` (missing, or not a regular file), without keeping it open:
    the cheap check a command makes before it writes anything; the reader then opens with :func:`open_input`."""
    open_input(path, what).close()


def remove_leftovers(directory: str | os.PathLike[str], name: str | None = None) -> list[Path]:
    """Delete temporary files and folders that writers killed mid-write left in ``directory`` (only
    those of ``name`` when given); a name whose process still runs is kept. Returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = _TEMP.fullmatch(entry.name)
        if match is None or (name is not None and match["name"] != name) or _alive(int(match["pid"])):
            continue
        _remove(Path(entry.path))
        removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    except OSError:  # pragma: no cover - platforms without signal 0
        return True
    return True
