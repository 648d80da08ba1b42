"""The logging backends: every metrics.jsonl record has its step and wall-clock time (continued over a resume);
TensorBoard's own reader reads back what metrics.jsonl says, each step once after a resume; names are checked."""

import sys

import numpy as np
import pytest

from tlm_train import MetricsLog, train
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
    expected = r"unknown logger\(s\) \['wandb'\]; expected some of \['jsonl', 'tensorboard'\]"
    with pytest.raises(ValueError, match=expected):
        choose_loggers(["wandb"], tmp_path)
    loggers = choose_loggers([], tmp_path)
    loggers.log({"step": 1, "time_s": 0.5, "train_loss": 2.0})
    loggers.close()
    assert MetricsLog(tmp_path / "metrics.jsonl").read() == [{"step": 1, "time_s": 0.5, "train_loss": 2.0}]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # importing it now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'tlm-train\[tensorboard\]'"):
        choose_loggers(["tensorboard"], tmp_path)
