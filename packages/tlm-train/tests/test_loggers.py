"""The logging backends: every metrics.jsonl record has its step and wall-clock time (continued over a resume);
TensorBoard's own reader reads back what metrics.jsonl says, each step once after a resume; names are checked."""

import errno
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tlm_train import MetricsLog, RunDir, train
from tlm_train.loggers import TENSORBOARD_DIR, choose_loggers


def _scalars(run, tag):
    """(step, value) of ``tag`` as TensorBoard's EventAccumulator reads the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / TENSORBOARD_DIR))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _expected(run, key):
    # TensorBoard keeps a scalar as a float32.
    return [(r["step"], float(np.float32(r[key]))) for r in MetricsLog(run / "metrics.jsonl").read() if key in r]


def test_every_record_has_its_step_and_time_and_a_resume_continues_the_clock(make_config, tmp_path) -> None:
    train(make_config(checkpoint_interval=2, eval_interval=2))
    train(make_config(checkpoint_interval=2, eval_interval=2, steps=6), resume=True)
    records = MetricsLog(tmp_path / "run" / "metrics.jsonl").read()
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 4, 5, 6]  # the resume's event record at step 4
    assert records[5]["event"] == "resume"
    times = [r["time_s"] for r in records]
    assert all(isinstance(t, float) and t >= 0 for t in times)
    assert times == sorted(times)  # the resumed process counts on from the first one's last record


def test_tensorboard_events_read_back_as_the_jsonl_and_a_resume_leaves_each_step_once(make_config, tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard logging needs the optional tensorboard package")
    run = tmp_path / "run"
    train(make_config(tensorboard=True, checkpoint_interval=2, eval_interval=2))
    assert _scalars(run, "loss/val") == _expected(run, "val_loss")
    assert _scalars(run, "loss/train") == _expected(run, "train_loss")
    assert [s for s, _ in _scalars(run, "loss/val")] == [0, 2, 4]
    # Back to step 2 with another learning rate: steps 3 and 4 are logged again with new values, and the
    # reader drops the first process's, as metrics.jsonl was truncated.
    train(make_config(tensorboard=True, checkpoint_interval=2, eval_interval=2, lr=1e-3), resume_from=2)
    train_loss = _scalars(run, "loss/train")
    assert [s for s, _ in train_loss] == [1, 2, 3, 4]
    assert train_loss == _expected(run, "train_loss")
    assert _scalars(run, "train/lr") == _expected(run, "lr")


def test_backends_are_chosen_by_name_and_a_missing_library_says_what_to_install(tmp_path, monkeypatch) -> None:
    expected = r"unknown logger\(s\) \['mlflow'\]; expected some of \['jsonl', 'tensorboard', 'wandb'\]"
    with pytest.raises(ValueError, match=expected):
        choose_loggers(["mlflow"], tmp_path)
    loggers = choose_loggers([], tmp_path)
    loggers.log({"step": 1, "time_s": 0.5, "train_loss": 2.0})
    loggers.close()
    assert MetricsLog(tmp_path / "metrics.jsonl").read() == [{"step": 1, "time_s": 0.5, "train_loss": 2.0}]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # importing it now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'tlm-train\[tensorboard\]'"):
        choose_loggers(["tensorboard"], tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'tlm-train\[wandb\]'"):
        choose_loggers(["wandb"], tmp_path)


def test_a_wandb_that_cannot_start_a_run_is_a_value_error_naming_the_flag(tmp_path, monkeypatch) -> None:
    import types

    class UsageError(Exception):  # wandb.errors.UsageError's place: a subclass of wandb.errors.Error
        pass

    def init(**kwargs):
        raise UsageError("No API key configured. Use `wandb login` to log in.")

    errors = types.SimpleNamespace(Error=Exception, UsageError=UsageError)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Settings=dict, errors=errors))
    expected = r"--wandb: W&B could not start a run: No API key configured\. .* \(WANDB_MODE=offline logs with no"
    with pytest.raises(ValueError, match=expected):
        choose_loggers(["wandb"], tmp_path)


class _FullDisk:
    """An event file on a disk that fills once ``room`` flushes have gone through: every write or flush after
    raises ENOSPC, as a full file system does."""

    def __init__(self, file, room):
        self.file, self.room = file, room

    def write(self, data):
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(data)

    def flush(self):
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= 1
        self.file.flush()

    def fileno(self):
        return self.file.fileno()

    def close(self):
        self.file.close()


def _fill_after(monkeypatch, room):
    from tlm_train import loggers

    create = loggers._create_in
    monkeypatch.setattr(loggers, "_create_in", lambda folder, name: _FullDisk(create(folder, name), room))


def _loads(checkpoint, step):
    from tlm_artifacts import load_step_model

    assert checkpoint.name == f"step_{step:08d}"
    model = load_step_model(checkpoint)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("checkpoint_fails", [False, True])
def test_a_full_disk_under_tensorboard_stops_the_run_with_a_checkpoint_that_loads(
    make_config, tmp_path, monkeypatch, checkpoint_fails
) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard logging needs the optional tensorboard package")
    from tlm_train import RunDir
    from tlm_train.checkpoint import CheckpointManager
    from tlm_train.loggers import LoggerError

    # One flush at the start, one per logged step (every step): the disk fills while step 5 is logged.
    _fill_after(monkeypatch, room=1 + 5)
    if checkpoint_fails:  # the same full disk refuses the checkpoint of step 5 too
        save = CheckpointManager.save

        def full(self, model, state):
            if state["step"] == 5:
                raise OSError(errno.ENOSPC, "No space left on device")
            return save(self, model, state)

        monkeypatch.setattr(CheckpointManager, "save", full)
    from tlm_train.recipe import Recipe

    monkeypatch.setattr(Recipe, "_sample", lambda self: pytest.fail("a run stopped by its logger samples nothing"))
    run = tmp_path / "run"
    with pytest.raises(LoggerError) as info:
        train(make_config(tensorboard=True, steps=8, checkpoint_interval=4, eval_interval=4, keep_checkpoints=3))
    message = str(info.value)
    assert message.startswith("the tensorboard logger failed: OSError: [Errno 28] No space left on device; ")
    assert message.endswith(f"; continue with --resume {run}")
    newest = RunDir(run).checkpoints().steps()[-1]
    path = RunDir(run).checkpoints().path(newest)
    if checkpoint_fails:
        assert f"stopped at step 5: no checkpoint of step 5 (No space left on device); the newest is {path};" in message
        assert newest == 4
    else:
        assert f"stopped at step 5: checkpoint {path};" in message and newest == 5
    _loads(path, newest)
    assert [r["step"] for r in MetricsLog(run / "metrics.jsonl").read()] == [0, 1, 2, 3, 4, 5]  # the jsonl goes on
    # The run continues from there to its end (a disk with room again).
    monkeypatch.undo()
    result = train(make_config(tensorboard=True, steps=8, checkpoint_interval=4, eval_interval=4), resume=True)
    assert result.step == 8 and not result.interrupted
    # TensorBoard reads both processes' files: the first one's up to the resumed step (step 5's scalars never
    # reached its disk), the second one's after it, each value the one metrics.jsonl holds.
    logged = _scalars(run, "loss/train")
    assert [s for s, _ in logged] == ([1, 2, 3, 4, 5, 6, 7, 8] if checkpoint_fails else [1, 2, 3, 4, 6, 7, 8])
    assert set(logged) <= set(_expected(run, "train_loss"))


def test_logger_errors_warn_trains_on_without_the_failed_logger(make_config, tmp_path, monkeypatch) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard logging needs the optional tensorboard package")
    _fill_after(monkeypatch, room=1 + 3)
    lines = []
    result = train(make_config(tensorboard=True, logger_errors="warn", eval_interval=2), log=lines.append)
    assert result.step == 4 and not result.interrupted
    said = [line for line in lines if "logger failed" in line]
    assert said == ["the tensorboard logger failed: OSError: [Errno 28] No space left on device; training goes on "
                    "without it (--logger-errors warn)"]  # fmt: skip
    run = tmp_path / "run"
    assert [r["step"] for r in MetricsLog(run / "metrics.jsonl").read()] == [0, 1, 2, 3, 4]
    assert [s for s, _ in _scalars(run, "loss/train")] == [1, 2]  # what reached the disk before it filled


def test_the_jsonl_logger_failing_stops_the_run_even_under_warn(make_config, tmp_path, monkeypatch) -> None:
    from tlm_train.loggers import LoggerError
    from tlm_train.metrics import MetricsLog as Log

    append = Log.append

    def full(self, record):
        if record["step"] >= 2 and "event" not in record:
            raise OSError(errno.EROFS, "Read-only file system")
        append(self, record)

    monkeypatch.setattr(Log, "append", full)
    with pytest.raises(LoggerError, match=r"^the jsonl logger failed: OSError: \[Errno 30\] Read-only file system; "
                                          r"stopped at step 2: checkpoint \S+/step_00000002; "):  # fmt: skip
        train(make_config(logger_errors="warn", checkpoint_interval=4))
    _loads(RunDir(tmp_path / "run").checkpoints().path(2), 2)


def test_a_removed_event_file_is_a_logger_failure(tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard logging needs the optional tensorboard package")
    from tlm_train.loggers import LoggerError

    loggers = choose_loggers(["tensorboard"], tmp_path)
    loggers.log({"step": 1, "train_loss": 2.0})
    for event_file in (tmp_path / TENSORBOARD_DIR).iterdir():
        event_file.unlink()  # writes to it would succeed, and be lost
    with pytest.raises(LoggerError, match="the event file was removed while the run wrote it"):
        loggers.log({"step": 2, "train_loss": 1.5})
    assert loggers.names == ["jsonl"]  # the failed backend is dropped, the others go on
    loggers.log({"step": 3, "train_loss": 1.0})
    loggers.close()
    assert [r["step"] for r in MetricsLog(tmp_path / "metrics.jsonl").read()] == [1, 2, 3]


@pytest.mark.slow  # a new interpreter (torch's import) training until its disk fills
def test_a_real_full_disk_under_tensorboard_stops_the_run_with_a_checkpoint_that_loads(make_config, tmp_path) -> None:
    """The same on a real file system that fills: ``tlm train --tensorboard`` with a 4 KiB tmpfs mounted at
    RUN/tensorboard, in a mount namespace of its own (gone with the process, however it ends; root on Linux)."""
    pytest.importorskip("tensorboard", reason="TensorBoard logging needs the optional tensorboard package")
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip(
            "a tmpfs in a private mount namespace needs root and unshare (Linux); the injected ENOSPC tests run"
        )
    run = tmp_path / "run"
    (run / TENSORBOARD_DIR).mkdir(parents=True)
    config = tmp_path / "train.toml"
    config.write_text(make_config(tensorboard=True, steps=200, checkpoint_interval=1000, eval_interval=1000).to_toml())
    mount = f"mount -t tmpfs -o size=4k tmpfs {run / TENSORBOARD_DIR}"
    if subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", mount], capture_output=True).returncode:
        pytest.skip("this machine refuses a tmpfs mount in a new mount namespace")
    train_command = f'exec "{sys.executable}" -m tlm train --config {config} --quiet'
    ended = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", f"{mount} && {train_command}"],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    steps = RunDir(run).checkpoints().steps()
    assert len(steps) == 1 and 1 <= steps[0] < 200  # the one checkpoint: the step the disk filled at
    path = RunDir(run).checkpoints().path(steps[0])
    assert (ended.returncode, ended.stdout) == (74, "")
    assert ended.stderr == (
        "tlm: error: the tensorboard logger failed: OSError: [Errno 28] No space left on device; stopped at step "
        f"{steps[0]}: checkpoint {path}; continue with --resume {run}\n"
    )
    _loads(path, steps[0])
    assert MetricsLog(run / "metrics.jsonl").read()[-1]["step"] == steps[0]
    assert list((run / TENSORBOARD_DIR).iterdir()) == []  # the tmpfs went with its namespace


def test_event_files_are_never_written_through_a_symlink_at_run_tensorboard(make_config, tmp_path, snapshot) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard logging needs the optional tensorboard package")
    from tlm_train.loggers import TensorBoardLogger

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("precious\n")
    before = snapshot(victim)
    run = tmp_path / "run"
    train(make_config(tensorboard=True))
    for event_file in (run / TENSORBOARD_DIR).iterdir():
        event_file.unlink()
    (run / TENSORBOARD_DIR).rmdir()
    (run / TENSORBOARD_DIR).symlink_to(victim, target_is_directory=True)
    message = rf"^{run / TENSORBOARD_DIR} is a symbolic link: tlm train never writes through one; remove it"
    with pytest.raises(ValueError, match=message):  # a resume is refused before anything is written
        train(make_config(tensorboard=True, steps=6), resume=True)
    with pytest.raises(ValueError, match=message):  # and the logger itself never follows one
        TensorBoardLogger(run)
    assert snapshot(victim) == before and RunDir(run).checkpoints().steps()[-1] == 4


def _events(folder):
    """Every event of the one event file in ``folder`` as TensorBoard's own loader reads it, wall time apart."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    (path,) = folder.iterdir()
    events = []
    for event in EventFileLoader(str(path)).Load():
        assert 0 < time.time() - event.wall_time < 600  # stamped when written
        event.ClearField("wall_time")
        event.ClearField("source_metadata")  # the writer's name: tensorboard's own event_file_writer there
        events.append(event)
    return events


@pytest.mark.parametrize("start_step", [0, 4])
def test_event_files_hold_what_torchs_summary_writer_writes(tmp_path, start_step) -> None:
    """The same events, in the same order, as ``torch.utils.tensorboard.SummaryWriter(purge_step=...)`` writes for
    the same scalars (the file-version header, the purge marks of a resume, one scalar summary per number)."""
    pytest.importorskip("tensorboard", reason="TensorBoard logging needs the optional tensorboard package")
    from torch.utils.tensorboard import SummaryWriter

    from tlm_train.loggers import TENSORBOARD_TAGS, TensorBoardLogger

    records = [{"step": 5, "train_loss": 2.5, "lr": 1e-3, "event": "x"}, {"step": 6, "val_loss": 2.25, "tokens": 640}]
    (tmp_path / "ours").mkdir()
    ours = TensorBoardLogger(tmp_path / "ours", start_step=start_step)
    reference = SummaryWriter(str(tmp_path / "torch"), purge_step=start_step + 1 if start_step else None)
    for record in records:
        ours.log(record)
        for key, tag in TENSORBOARD_TAGS.items():
            if key in record:
                reference.add_scalar(tag, record[key], global_step=record["step"])
    ours.close()
    reference.close()
    assert _events(tmp_path / "ours" / TENSORBOARD_DIR) == _events(tmp_path / "torch")


def test_the_event_folder_and_file_are_made_as_open_and_mkdir_make_them_and_a_failed_start_closes_its_file(
    tmp_path, monkeypatch
) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard logging needs the optional tensorboard package")
    from tlm_train import loggers

    before, descriptors = os.umask(0), len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    try:
        logger = loggers.TensorBoardLogger(tmp_path)
        logger.close()
    finally:
        os.umask(before)
    if descriptors:  # the folder's descriptor is closed once the file is made, the file's at close()
        assert len(os.listdir("/proc/self/fd")) == descriptors
    (event_file,) = (tmp_path / TENSORBOARD_DIR).iterdir()
    assert oct((tmp_path / TENSORBOARD_DIR).stat().st_mode & 0o7777) == oct(0o777)
    assert oct(event_file.stat().st_mode & 0o7777) == oct(0o666)
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / TENSORBOARD_DIR).write_text("not a folder\n")
    with pytest.raises(NotADirectoryError) as info:
        loggers.TensorBoardLogger(tmp_path / "file")
    assert info.value.errno == errno.ENOTDIR
    opened = []
    create = loggers._create_in
    monkeypatch.setattr(loggers, "_create_in", lambda f, n: opened.append(_FullDisk(create(f, n), 0)) or opened[-1])
    (tmp_path / "full").mkdir()
    with pytest.raises(OSError, match="No space left on device"):  # a disk full from the start: the run refuses
        loggers.TensorBoardLogger(tmp_path / "full")
    assert opened[0].file.closed


def test_when_several_backends_fail_at_once_the_first_is_named_and_every_failed_one_leaves() -> None:
    from tlm_train.loggers import LoggerError, Loggers

    class Failing:
        def __init__(self, error):
            self.error, self.closed = error, False

        def log(self, record):
            raise self.error

        def close(self):
            self.closed = True
            raise OSError("closing fails too")

    class Kept:
        def __init__(self):
            self.records = []

        def log(self, record):
            self.records.append(record)

        def close(self):
            pass

    first, second, kept = Failing(OSError(28, "No space left on device")), Failing(PermissionError("no")), Kept()
    loggers = Loggers([first, kept, second], ["disk", "kept", "other"])
    with pytest.raises(LoggerError, match=r"^the disk logger failed: OSError: \[Errno 28\] No space left on device$"):
        loggers.log({"step": 1})
    assert first.closed and second.closed and loggers.names == ["kept"] and loggers.backends == [kept]
    loggers.log({"step": 2})
    assert kept.records == [{"step": 1}, {"step": 2}]


def test_a_loss_plot_the_disk_refuses_is_a_log_line_and_the_run_ends(make_config, monkeypatch) -> None:
    from tlm_train import recipe

    def full(metrics, png):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(recipe, "plot_loss_curve", full)
    lines = []
    result = train(make_config(sample_tokens=0), log=lines.append)
    assert result.step == 4 and not result.interrupted and "no loss.png: No space left on device" in lines


def _wandb_records(path):
    """The protobuf records of a W&B run file (``run-ID.wandb``): LevelDB's log format after W&B's 7-byte header,
    chunks of (CRC32, length, type) in 32 KiB blocks, read here without W&B's own code."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00"  # the magic, 0xBEE1 and version 0
    pos, parts = 7, []
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


@pytest.mark.slow  # W&B starts its own service process: seconds
def test_wandb_offline_run_holds_the_jsonl_metrics_and_the_run_settings(make_config, tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="W&B logging needs the optional wandb package")
    from tlm_train.loggers import TENSORBOARD_TAGS

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "tlm-test")
    for name in ("WANDB_DIR", "WANDB_API_KEY", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    run = tmp_path / "run"
    train(make_config(wandb=True, eval_interval=2))
    import wandb

    wandb.teardown()  # W&B's service writes the run file in the background: complete once the service stops
    (file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    history, settings = {}, {}
    for record in _wandb_records(file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            # A key with "/" is stored split, in nested_key.
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind == "run":
            settings = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            assert (record.run.display_name, record.run.project) == ("run", "tlm-test")
    expected = {}
    for record in MetricsLog(run / "metrics.jsonl").read():
        values = {tag: record[key] for key, tag in TENSORBOARD_TAGS.items() if key in record}
        expected.setdefault(record["step"], {}).update(values)
    assert history == expected and sorted(history) == [0, 1, 2, 3, 4]
    assert history[4]["loss/val"] == MetricsLog(run / "metrics.jsonl").read()[-1]["val_loss"]
    saved = RunDir(run).read_config()
    assert settings["steps"] == saved.steps == 4 and settings["model"] == saved.model  # train.toml's settings


def test_wandb_gets_the_runs_folder_and_only_the_numbers_of_a_record(tmp_path, monkeypatch) -> None:
    # wandb stands in here (the real one starts a service process: the slow test below). W&B writes its files under
    # DIR/wandb for wandb.init(dir=DIR), so DIR is the run folder; it logs numbers: a bool, None or text is left out,
    # and a record without a number logs nothing.
    import types

    calls = []
    fake = types.ModuleType("wandb")
    fake.Settings = lambda **kwargs: kwargs
    fake.init = lambda **kwargs: (
        calls.append(("init", kwargs))
        or types.SimpleNamespace(
            log=lambda values, step: calls.append(("log", values, step)), finish=lambda: calls.append(("finish",))
        )
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "run"
    run.mkdir()
    loggers = choose_loggers(["wandb"], run)
    loggers.log({"step": 3, "time_s": 1.0, "train_loss": 2.5, "lr": 0.001, "tokens": 1024, "grad_norm": None,
                 "mfu": True, "val_loss": "n/a"})  # fmt: skip
    loggers.log({"step": 4, "time_s": 2.0, "grad_norm": None})
    loggers.close()
    (init,) = [c[1] for c in calls if c[0] == "init"]
    assert init["dir"] == str(run) and (run / "wandb").is_dir()
    logged = [c for c in calls if c[0] == "log"]
    assert logged == [("log", {"loss/train": 2.5, "train/lr": 0.001, "train/tokens": 1024}, 3)]
