"""RunDir: the paths of a run folder, its train.toml, and the lock (a held lock refuses, a released one does not)."""

import pytest

from tlm_train import RunDir, RunInUseError, TrainConfig


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
