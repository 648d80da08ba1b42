"""metrics.jsonl (a line cut by a kill is dropped; truncation for resume), the loss plot, MFU's two parts."""

import json
import sys

import pytest

from tlm_model import ModelConfig
from tlm_model.accounting import account
from tlm_train import MetricsLog, plot_loss_curve
from tlm_train.metrics import measure_gemm_flops, training_flops_per_token


def test_a_line_cut_by_a_kill_is_dropped_and_truncate_keeps_earlier_steps(tmp_path) -> None:
    log = MetricsLog(tmp_path / "m.jsonl")
    for step in range(5):
        log.append({"step": step, "train_loss": 1.0 / (step + 1)})
    log.append({"step": 2, "event": "resume", "changed": {"lr": 0.1}})
    with (tmp_path / "m.jsonl").open("a") as file:
        file.write('{"step": 5, "tr')  # a line cut short by SIGKILL
    assert [r["step"] for r in log.read()] == [0, 1, 2, 3, 4, 2]
    log.truncate(2)
    assert [r["step"] for r in log.read()] == [0, 1, 2, 2]
    assert json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])["event"] == "resume"
    log.truncate(-1)
    assert log.read() == [] and MetricsLog(tmp_path / "none.jsonl").read() == []


def test_the_plot_is_written_whole_and_skipped_without_matplotlib(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib", reason="the loss plot is drawn with the optional matplotlib")
    log = MetricsLog(tmp_path / "m.jsonl")
    for step in range(1, 4):
        log.append({"step": step, "train_loss": 3.0 / step, **({"val_loss": 2.0} if step == 3 else {})})
    assert plot_loss_curve(tmp_path / "m.jsonl", tmp_path / "loss.png") == tmp_path / "loss.png"
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert plot_loss_curve(tmp_path / "m.jsonl", tmp_path / "other.png") is None
    assert not (tmp_path / "other.png").exists()


def test_training_flops_are_three_forwards_of_causal_attention() -> None:
    config = ModelConfig(100, 32, 64, 2, 4, 128)
    report = account(config, batch_size=1, seq_len=32)
    assert training_flops_per_token(config, 32) == 3 * report.forward_flops_causal / 32
    assert measure_gemm_flops("cpu", size=64, repeats=1) > 0
