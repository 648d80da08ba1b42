import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tlm_core import atomic
from tlm_core.atomic import (
    atomic_file,
    atomic_path,
    atomic_write,
    is_current,
    read_dir_files,
    remove_leftovers,
    replace_dir,
)


def _run(code: str, *args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    prefix = f"import os\nos.umask({umask})\n" if umask is not None else ""
    return subprocess.run([sys.executable, "-c", prefix + textwrap.dedent(code), *args], capture_output=True, text=True)


def test_write_bytes_text_and_callable(tmp_path):
    atomic_write(tmp_path / "a", b"\x00\x01")
    atomic_write(tmp_path / "b", "héllo")
    atomic_write(tmp_path / "c", lambda f: f.write(b"xyz"))
    assert (tmp_path / "a").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b").read_text(encoding="utf-8") == "héllo"
    assert (tmp_path / "c").read_bytes() == b"xyz"
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_new_files_and_folders_honour_the_umask(tmp_path, umask, file_mode, dir_mode):
    code = """
    import sys, os
    from tlm_core.atomic import atomic_write, replace_dir
    atomic_write(sys.argv[1] + "/f", b"x")
    replace_dir(sys.argv[1] + "/d", lambda p: (p / "g").write_bytes(b"y"))
    """
    result = _run(code, str(tmp_path), umask=umask)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "f").stat().st_mode & 0o777 == file_mode
    assert (tmp_path / "d").stat().st_mode & 0o777 == dir_mode


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "t"
    target.write_bytes(b"old")

    def fail(f):
        f.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, fail)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["t"]


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (tmp_path / "t").symlink_to(victim)
    atomic_write(tmp_path / "t", b"new")
    assert victim.read_bytes() == b"keep"
    assert not (tmp_path / "t").is_symlink() and (tmp_path / "t").read_bytes() == b"new"


def test_a_folder_is_not_a_file_target(tmp_path):
    with pytest.raises(IsADirectoryError):
        with atomic_file(tmp_path):
            pass


def test_sigkill_while_writing_leaves_old_or_new_never_a_mix(tmp_path):
    target = tmp_path / "t"
    target.write_bytes(b"A" * 4_000_000)
    code = """
    import sys
    from tlm_core.atomic import atomic_write
    i = 0
    while True:
        i += 1
        atomic_write(sys.argv[1], bytes([65 + i % 26]) * 4_000_000)
    """
    for delay in (0.05, 0.2, 0.4, 0.7):
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(target)])
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        data = target.read_bytes()
        assert len(data) == 4_000_000 and data == data[:1] * len(data)
    # The killed writers' temporary files: removed as leftovers once their processes are gone.
    removed = remove_leftovers(tmp_path, "t")
    assert os.listdir(tmp_path) == ["t"]
    assert all(p.name.startswith(".t.") for p in removed)


def test_remove_leftovers_keeps_a_live_writers_temporary(tmp_path):
    live = tmp_path / f".t.{os.getpid()}-{'0' * 16}.tmp"
    dead = tmp_path / f".t.{2**22 + 12345}-{'1' * 16}.tmp"
    other = tmp_path / ".t.not-a-temp"
    for p in (live, dead, other):
        p.write_bytes(b"")
    (tmp_path / f".u.{2**22 + 12345}-{'2' * 16}.old").mkdir()
    assert remove_leftovers(tmp_path, "t") == [dead]
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name, f".u.{2**22 + 12345}-{'2' * 16}.old"])
    assert len(remove_leftovers(tmp_path)) == 1  # the .u folder, whatever its name
    assert remove_leftovers(tmp_path / "missing") == []


def _version(n: int):
    def fill(folder: Path) -> None:
        for name in ("a", "b", "c"):
            (folder / name).write_text(f"{n}\n" * 1000)

    return fill


def test_replace_dir_replaces_everything_and_keeps_nothing_old(tmp_path):
    target = tmp_path / "d"
    replace_dir(target, _version(1))
    (target / "stale").write_text("from an older version")
    replace_dir(target, _version(2))
    assert sorted(os.listdir(target)) == ["a", "b", "c"]
    assert read_dir_files(target, ["a", "b", "c"])["b"] == b"2\n" * 1000
    assert os.listdir(tmp_path) == ["d"]


def test_replace_dir_failure_leaves_the_old_folder(tmp_path):
    target = tmp_path / "d"
    replace_dir(target, _version(1))

    def fail(folder):
        (folder / "a").write_text("half")
        raise OSError("no space left")

    with pytest.raises(OSError, match="no space"):
        replace_dir(target, fail)
    assert read_dir_files(target, ["a"])["a"] == b"1\n" * 1000
    assert os.listdir(tmp_path) == ["d"]


def test_replace_dir_refuses_a_file_and_replaces_a_symlink_without_following_it(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        replace_dir(tmp_path / "f", _version(1))
    elsewhere = tmp_path / "elsewhere"
    replace_dir(elsewhere, _version(7))
    (tmp_path / "link").symlink_to(elsewhere)
    replace_dir(tmp_path / "link", _version(8))
    assert not (tmp_path / "link").is_symlink()
    assert read_dir_files(elsewhere, ["a"])["a"] == b"7\n" * 1000


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_readers_never_see_a_mix_or_a_missing_folder_while_writers_replace_it(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    target = tmp_path / "d"
    replace_dir(target, _version(0))
    stop, problems = threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            try:
                files = read_dir_files(target, ["a", "b", "c"])
            except FileNotFoundError as err:
                if exchange:  # an exchange never leaves the path missing
                    problems.append(err)
                continue
            if len(set(files.values())) != 1:
                problems.append(files)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for thread in readers:
        thread.start()
    for n in range(1, 60):
        replace_dir(target, _version(n))
    stop.set()
    for thread in readers:
        thread.join()
    assert problems == []
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_concurrent_writers_each_leave_one_complete_version(tmp_path):
    target = tmp_path / "d"
    code = """
    import sys
    from pathlib import Path
    from tlm_core.atomic import replace_dir
    n = int(sys.argv[2])
    for i in range(30):
        replace_dir(sys.argv[1], lambda p: [(p / x).write_text(f"{n}-{i}") for x in "abc"])
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(target), str(n)]) for n in range(3)]
    assert [p.wait() for p in procs] == [0, 0, 0]
    files = read_dir_files(target, ["a", "b", "c"])
    assert len(set(files.values())) == 1
    assert sorted(os.listdir(tmp_path)) == ["d"]


@pytest.mark.parametrize("step", ["filled", "swapped"])
def test_sigkill_inside_replace_dir_leaves_old_or_new_and_leftovers_are_removed(tmp_path, step):
    target = tmp_path / "d"
    replace_dir(target, _version(1))
    code = f"""
    import os, signal, sys
    from pathlib import Path
    from tlm_core import atomic
    atomic.after_step = lambda s: os.kill(os.getpid(), signal.SIGKILL) if s == {step!r} else None
    atomic.replace_dir(sys.argv[1], lambda p: [(p / x).write_text("2") for x in "abc"])
    """
    assert _run(code, str(target)).returncode == -signal.SIGKILL
    files = read_dir_files(target, ["a", "b", "c"])
    assert files in ({name: b"1\n" * 1000 for name in "abc"}, {name: b"2" for name in "abc"})
    remove_leftovers(tmp_path)
    assert os.listdir(tmp_path) == ["d"]


def test_read_dir_files_optional_and_missing(tmp_path):
    replace_dir(tmp_path / "d", _version(3))
    got = read_dir_files(tmp_path / "d", ["a"], optional=["nope", "b"])
    assert set(got) == {"a", "b"}
    with pytest.raises(FileNotFoundError, match="missing from the folder"):
        read_dir_files(tmp_path / "d", ["nope"])
    with pytest.raises(NotADirectoryError):
        read_dir_files(tmp_path / "d" / "a", ["x"])


def test_create_new_never_follows_a_planted_symlink_nor_truncates_a_file(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "link").symlink_to(victim)
    for name in ("link", "victim.txt"):
        with pytest.raises(FileExistsError):
            atomic.create_new(tmp_path / name)
    assert victim.read_text() == "precious\n"
    with atomic.create_new(tmp_path / "fresh") as file:
        file.write(b"new")
    assert (tmp_path / "fresh").read_bytes() == b"new"


def test_is_current_until_the_folder_is_replaced_or_removed(tmp_path):
    replace_dir(tmp_path / "d", _version(1))
    fd = os.open(tmp_path / "d", os.O_RDONLY)
    try:
        assert is_current(fd, tmp_path / "d")
        replace_dir(tmp_path / "d", _version(2))  # same path, another folder
        assert not is_current(fd, tmp_path / "d")
        assert not is_current(fd, tmp_path / "gone")
    finally:
        os.close(fd)


def _record_fsyncs(monkeypatch, target: Path) -> list[tuple[tuple[int, int], bool, bytes | None]]:
    """Every ``os.fsync`` as (the synced file's (st_dev, st_ino), whether it is a folder, what ``target``
    held at that moment: its bytes for a file, its entries' names joined for a folder)."""
    synced: list[tuple[tuple[int, int], bool, bytes | None]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        if not target.exists():
            now = None
        elif target.is_dir():
            now = b",".join(sorted(name.encode() for name in os.listdir(target)))
        else:
            now = target.read_bytes()
        synced.append(((st.st_dev, st.st_ino), stat.S_ISDIR(st.st_mode), now))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def _key(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    target = tmp_path / "t"
    target.write_bytes(b"old")
    synced = _record_fsyncs(monkeypatch, target)
    atomic_write(target, b"new")
    # The new file's inode is synced while the target still holds the old bytes (before os.replace);
    # the folder is synced once the target holds the new ones (the rename made durable).
    assert (_key(target), False, b"old") in synced
    assert (_key(tmp_path), True, b"new") in synced
    assert synced.index((_key(target), False, b"old")) < synced.index((_key(tmp_path), True, b"new"))


def test_replace_dir_fsyncs_every_file_and_folder_before_the_swap_and_the_parent_after(tmp_path, monkeypatch):
    target = tmp_path / "d"
    replace_dir(target, _version(1))
    synced = _record_fsyncs(monkeypatch, target)

    def fill(folder: Path) -> None:
        (folder / "sub").mkdir()
        (folder / "sub" / "x").write_bytes(b"2")
        (folder / "y").write_bytes(b"2")

    replace_dir(target, fill)
    before_swap = b"a,b,c"  # what the target lists until the new folder is in place
    for path in (target / "sub" / "x", target / "y", target / "sub", target):
        assert (_key(path), path.is_dir(), before_swap) in synced, path
    assert (_key(tmp_path), True, b"sub,y") in synced  # the parent, after the new folder is in place


def test_a_failed_second_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    target = tmp_path / "d"
    replace_dir(target, _version(1))
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # the two-rename path
    real = os.rename

    def rename(src, dst):
        if Path(src).name.endswith(".tmp") and Path(dst) == target:
            raise OSError(28, "No space left on device")  # the new folder cannot be moved in
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="No space left"):
        replace_dir(target, _version(2))
    assert read_dir_files(target, ["a", "b", "c"]) == {name: b"1\n" * 1000 for name in "abc"}
    assert os.listdir(tmp_path) == ["d"]  # neither the moved-aside old folder nor the new one is left


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in Linux's /proc/self/fd")
def test_no_descriptor_is_left_open_by_writes_reads_or_failures(tmp_path):
    def fail(_):
        raise RuntimeError("fail")

    replace_dir(tmp_path / "d", _version(1))
    before = _open_fds()
    atomic_write(tmp_path / "f", b"x")
    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "f", fail)
    replace_dir(tmp_path / "d", _version(2))
    with pytest.raises(RuntimeError):
        replace_dir(tmp_path / "d", fail)
    read_dir_files(tmp_path / "d", ["a"], optional=["nope"])
    with pytest.raises(FileNotFoundError):
        read_dir_files(tmp_path / "d", ["nope"])
    atomic.fsync_dir(tmp_path)
    atomic.fsync_dir(tmp_path / "missing")
    assert _open_fds() == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2(RENAME_EXCHANGE) is Linux's")
def test_replace_dir_swaps_a_relative_path_in_one_step(tmp_path, monkeypatch):
    # renameat2 resolves a relative path against its folder descriptor, which must be AT_FDCWD (-100 in
    # Linux's fcntl.h) for the current folder; an absolute path ignores the descriptor.
    monkeypatch.chdir(tmp_path)
    replace_dir("d", _version(1))
    (tmp_path / "d" / "stale").write_text("old")
    swaps: list[bool] = []
    real = atomic._exchange
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: swaps.append(real(a, b)) or swaps[-1])
    replace_dir("d", _version(2))
    assert swaps == [True]  # one renameat2 swap, not the two-rename fallback
    assert read_dir_files("d", ["a", "b", "c"]) == {name: b"2\n" * 1000 for name in "abc"}
    assert sorted(os.listdir(tmp_path)) == ["d"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2(RENAME_EXCHANGE) is Linux's")
def test_a_failed_swap_is_raised_with_the_errno_that_renameat2_set(tmp_path):
    # renameat2(2): RENAME_EXCHANGE needs both paths to exist, else ENOENT. The errno is read through ctypes,
    # which only keeps it for a library loaded with use_errno=True (else get_errno() answers its own 0).
    import errno

    (tmp_path / "a").mkdir()
    with pytest.raises(FileNotFoundError) as raised:
        atomic._exchange(tmp_path / "a", tmp_path / "absent")
    assert raised.value.errno == errno.ENOENT and raised.value.filename == str(tmp_path / "absent")
    assert os.listdir(tmp_path) == ["a"]


def test_replace_dir_creates_the_missing_parent_folders(tmp_path):
    target = tmp_path / "runs" / "2026" / "d"
    assert replace_dir(target, _version(1)) == target
    assert read_dir_files(target, ["a"]) == {"a": b"1\n" * 1000}


def test_a_missing_file_is_reported_on_a_file_system_that_counts_one_link_per_folder(tmp_path, monkeypatch):
    # btrfs reports st_nlink == 1 for every folder (ext4 counts 2 + subfolders); a folder unlinked under a
    # reader has 0. A live folder with one link is current, so the missing file is missing, not a retired folder.
    replace_dir(tmp_path / "d", _version(1))
    real = os.stat

    def stat_one_link(path, *args, **kwargs):
        st = real(path, *args, **kwargs)
        if not isinstance(path, int):
            return st
        fields = list(st)
        fields[stat.ST_NLINK] = 1
        return os.stat_result(fields)

    monkeypatch.setattr(os, "stat", stat_one_link)
    with pytest.raises(FileNotFoundError, match="missing from the folder"):
        read_dir_files(tmp_path / "d", ["nope"])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_open_input_refuses_what_is_not_a_regular_file_without_blocking(tmp_path):
    from tlm_core.atomic import check_input, open_input

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # no writer: a blocking open would hang here
    cases = [(fifo, "a FIFO (named pipe)"), (tmp_path, "a folder")]
    if os.path.exists("/dev/null"):
        cases.append((Path("/dev/null"), "a character device"))
    for path, kind in cases:
        for check in (open_input, check_input):
            with pytest.raises(ValueError, match=rf"^--flag {path}: {re.escape(kind)}, expected a regular file$"):
                check(path, "--flag")
    with pytest.raises(FileNotFoundError, match=r"--flag \S+absent: no such file"):
        open_input(tmp_path / "absent", "--flag")
    regular = tmp_path / "data"
    regular.write_bytes(b"abc")
    with open_input(regular, "--flag") as handle:
        os.replace(fifo, regular)  # what the name now says does not matter: the checked handle is read
        assert handle.read() == b"abc" and os.get_blocking(handle.fileno())


def test_the_bytes_are_in_the_file_when_it_is_fsynced(tmp_path, monkeypatch):
    # fsync makes durable what the kernel has: Python's buffer must be flushed into the file first.
    sizes, real = [], os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            sizes.append(os.fstat(fd).st_size)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_write(tmp_path / "t", b"x" * 100)  # far below the buffer's size: only a flush writes it
    assert sizes == [100]


def test_a_file_system_that_cannot_exchange_falls_back_to_two_renames(tmp_path, monkeypatch):
    # renameat2 answering EINVAL (a file system without RENAME_EXCHANGE) must not be taken for a swap.
    import ctypes
    import errno

    class Libc:
        @staticmethod
        def renameat2(*args):
            return -1

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: Libc())
    monkeypatch.setattr(ctypes, "get_errno", lambda: errno.EINVAL)
    target = tmp_path / "d"
    replace_dir(target, _version(1))
    replace_dir(target, _version(2))
    assert read_dir_files(target, ["a", "b", "c"]) == {name: b"2\n" * 1000 for name in "abc"}
    assert os.listdir(tmp_path) == ["d"]


def test_a_rename_that_fails_for_another_reason_than_a_race_is_raised_at_once(tmp_path, monkeypatch):
    import errno

    target, real, calls = tmp_path / "d", os.rename, []

    def rename(src, dst):
        calls.append(dst)
        if Path(dst) == target:
            raise PermissionError(errno.EACCES, "Permission denied", str(dst))
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(PermissionError, match="Permission denied"):
        replace_dir(target, _version(1))
    assert calls == [target] and os.listdir(tmp_path) == []  # one try, and the new folder is cleaned up


def _within(seconds, call):
    """``call()``'s exception or result, run in a thread that must end within ``seconds`` (a FIFO read would hang)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except Exception as err:
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the read blocked"
    return outcome


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_read_dir_files_and_read_input_refuse_a_fifo_without_blocking(tmp_path):
    from tlm_core.atomic import read_input

    (tmp_path / "a.json").write_bytes(b"{}")
    os.mkfifo(tmp_path / "b.json")  # no writer: a blocking open would hang here
    for names, optional in ((["a.json", "b.json"], ()), ([], ("b.json",))):
        error = _within(10, lambda names=names, optional=optional: read_dir_files(tmp_path, names, optional=optional))
        assert isinstance(error.get("error"), ValueError)
        assert str(error["error"]) == f"{tmp_path / 'b.json'}: a FIFO (named pipe), expected a regular file"
    assert read_dir_files(tmp_path, ["a.json"]) == {"a.json": b"{}"}
    error = _within(10, lambda: read_input(tmp_path / "b.json", "--flag"))["error"]
    assert isinstance(error, ValueError) and "a FIFO (named pipe), expected a regular file" in str(error)
    assert read_input(tmp_path / "a.json", "--flag") == b"{}"
    assert read_input(tmp_path / "a.json", "--flag", limit=2) == b"{}"
    with pytest.raises(ValueError, match=r"^--flag \S+a.json: over 1 bytes, too large for what it should hold$"):
        read_input(tmp_path / "a.json", "--flag", limit=1)


def test_atomic_path_puts_in_place_what_a_library_wrote_by_name(tmp_path):
    target = tmp_path / "t"
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    target.symlink_to(victim)
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.read_bytes() == b""  # made for the library, empty
        with open(tmp, "wb") as f:  # as a library writing by name does
            f.write(b"new")
    assert target.read_bytes() == b"new" and not target.is_symlink() and victim.read_bytes() == b"keep"

    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("disk full")
    assert target.read_bytes() == b"new"
    with pytest.raises(FileNotFoundError, match="replaced or removed before it was put in place"):
        with atomic_path(target) as tmp:
            (tmp_path / "other").write_bytes(b"swapped")
            os.replace(tmp_path / "other", tmp)  # not the file made for it: refused, not renamed in
    assert target.read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["t", "victim"]  # no temporary left
