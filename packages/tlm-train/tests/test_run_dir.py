"""RunDir: the paths of a run folder, its train.toml, and the lock (a held lock refuses, a released one does not)."""

import os
import stat

import pytest

from tlm_train import RunDir, RunInUseError, TrainConfig
from tlm_train.run_dir import RunLock


def test_a_run_folder_is_one_with_train_toml_or_checkpoints(tmp_path) -> None:
    assert not RunDir.is_run(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert RunDir.is_run(tmp_path)
    other = tmp_path / "other"
    RunDir(other).path.mkdir()
    RunDir(other).write_config(TrainConfig(steps=7))
    assert RunDir.is_run(other) and RunDir(other).read_config().steps == 7
    assert RunDir(other).read_config(steps=9).steps == 9
    with pytest.raises(FileNotFoundError, match="no train.toml here, so it is not a tlm train run"):
        RunDir(tmp_path / "missing").read_config()
    assert RunDir(tmp_path).tokenizer() is None


def test_a_held_lock_refuses_a_second_holder_and_is_free_once_released(tmp_path) -> None:
    run = RunDir(tmp_path / "run")
    with run.lock() as held:
        held.record()
        with pytest.raises(RunInUseError, match=r"run is in use by another tlm train \(pid \d+ on "):
            with run.lock():
                pass
    with run.lock() as again:  # released: the next one takes it
        again.record()
    assert (tmp_path / "run" / ".lock").exists()


def test_the_lock_creates_a_nested_run_folder(tmp_path) -> None:
    run = RunDir(tmp_path / "runs" / "2026" / "first")
    with run.lock() as held:
        held.record()
    assert (tmp_path / "runs" / "2026" / "first" / ".lock").is_file()


def test_a_holder_that_never_recorded_itself_is_described_honestly(tmp_path) -> None:
    run = RunDir(tmp_path / "run")
    with run.lock():
        with pytest.raises(RunInUseError, match="a process that has not recorded itself yet"):
            with run.lock():
                pass


@pytest.mark.parametrize(
    ("out", "how"),
    [
        ("inputs/model", "is"),
        ("inputs/model/finetune", "lies inside"),
        ("inputs", "holds"),
        ("link", "is"),  # a symlink to the input folder
        ("link/sub", "lies inside"),
        ("inputs/model/../model", "is"),
    ],
)
def test_an_out_dir_overlapping_an_input_is_refused_through_symlinks(tmp_path, monkeypatch, out, how) -> None:
    from tlm_train.run_dir import check_apart

    monkeypatch.chdir(tmp_path)
    (tmp_path / "inputs" / "model").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "inputs" / "model", target_is_directory=True)
    with pytest.raises(ValueError, match=f"^--out-dir {out} {how} --init-from inputs/model: a run writes into"):
        check_apart(out, {"--tokenizer": [], "--init-from": ["inputs/model"]})
    check_apart("inputs/model2", {"--init-from": ["inputs/model"]})  # a sibling whose name extends it is apart
    check_apart("runs/a", {"--data": ["inputs/model", "runs/ab.npy"]})


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_the_lock_file_is_created_with_open_s_default_mode(tmp_path) -> None:
    # Like open(): 0o666 less the umask, and no execute bit (stat's modes, which root does not bypass).
    with RunDir(tmp_path / "run").lock() as held:
        held.record()
    assert stat.S_IMODE(os.stat(tmp_path / "run" / ".lock").st_mode) == 0o666 & ~_umask()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in Linux's /proc/self/fd")
def test_the_lock_leaves_no_descriptor_open_once_released_or_refused(tmp_path) -> None:
    run = RunDir(tmp_path / "run")
    os.mkfifo(tmp_path / "fifo")  # opens read-write without blocking on Linux, and is no regular file
    before = len(os.listdir("/proc/self/fd"))
    with run.lock() as held:
        held.record()
        assert len(os.listdir("/proc/self/fd")) == before + 1  # the one descriptor that holds the flock
        with pytest.raises(RunInUseError):
            with run.lock():
                pass
    with pytest.raises(ValueError, match="is not a regular file"):
        RunLock(tmp_path / "fifo")
    assert len(os.listdir("/proc/self/fd")) == before
