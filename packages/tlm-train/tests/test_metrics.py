"""metrics.jsonl (a line cut by a kill is dropped; truncation for resume), the loss plot, MFU's two parts."""

import json
import sys

import pytest
import torch

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


def test_the_gemm_rate_is_2n3_flops_over_the_best_time(monkeypatch) -> None:
    # A fake clock that each matmul advances by a chosen time: the rate is an n x n by n x n float32
    # matmul's 2 n**3 FLOPs over the fastest call (1024 and 1 + 5 calls by default).
    from tlm_train import metrics

    clock = [0.0]
    durations = iter([9.0, 0.5, 0.25, 0.75, 0.5, 1.0])
    calls = []

    def mm(a, b):
        calls.append((tuple(a.shape), tuple(b.shape), a.dtype, b.dtype))
        clock[0] += next(durations)
        return a

    monkeypatch.setattr(metrics.torch, "mm", mm)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    assert measure_gemm_flops() == 2 * 1024**3 / 0.25
    assert calls == [((1024, 1024), (1024, 1024), torch.float32, torch.float32)] * 6


def test_the_plot_draws_each_logged_loss_against_its_step(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib", reason="the loss plot is drawn with the optional matplotlib")
    import matplotlib.pyplot as plt

    closed = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (closed.append(fig), close(fig)))
    log = MetricsLog(tmp_path / "m.jsonl")
    records = [
        {"step": s, "train_loss": 3.0 / s, **({"val_loss": 2.5 - s / 4} if s % 2 == 0 else {})} for s in range(1, 6)
    ]
    for record in records:
        log.append(record)
    plot_loss_curve(tmp_path / "m.jsonl", tmp_path / "loss.png")
    (fig,) = closed
    (ax,) = fig.axes
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert drawn == {
        "train": ([r["step"] for r in records], [r["train_loss"] for r in records]),
        "validation (each evaluation)": ([2, 4], [2.0, 1.5]),
    }
    # Each evaluation a marker and no line between two: a line would draw losses that no evaluation measured.
    validation = ax.get_lines()[1]
    assert (validation.get_marker(), validation.get_linestyle()) == ("o", "None")
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["train", "validation (each evaluation)"]


def test_a_symlink_planted_at_the_log_mid_run_is_an_error_not_followed(tmp_path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "m.jsonl").symlink_to(victim)
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        MetricsLog(tmp_path / "m.jsonl").append({"step": 1})
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize(
    ("name", "dtype", "tf32", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", True, (989.4e12, "NVIDIA H100 SXM, bfloat16 dense peak")),
        ("NVIDIA H100 PCIe", "bfloat16", True, (756e12, "NVIDIA H100 PCIe, bfloat16 dense peak")),
        ("NVIDIA H200", "float32", True, (494.7e12, "NVIDIA H200 SXM, TF32 dense peak")),
        ("NVIDIA H200", "float32", False, (66.9e12, "NVIDIA H200 SXM, float32 peak")),
        ("NVIDIA A100-SXM4-80GB", "float16", True, (312e12, "NVIDIA A100, float16 dense peak")),
        ("NVIDIA L4", "bfloat16", True, (121e12, "NVIDIA L4, bfloat16 dense peak")),
        ("NVIDIA L40S", "bfloat16", True, (362.05e12, "NVIDIA L40S, bfloat16 dense peak")),
        ("NVIDIA GeForce RTX 4090", "bfloat16", True, (165.2e12, "NVIDIA GeForce RTX 4090, bfloat16 dense peak")),
        ("NVIDIA A10", "bfloat16", True, (125e12, "NVIDIA A10, bfloat16 dense peak")),
        ("Some Future GPU", "bfloat16", True, None),
        ("NVIDIA H100 80GB HBM3", "float64", True, None),
    ],
)
def test_published_peaks_by_device_name(name, dtype, tf32, expected) -> None:
    # The datasheets' dense (no 2:4 sparsity) figures; an H100 run in bfloat16 is measured against 989 TFLOP/s,
    # not a float32 GEMM 15x slower.
    from tlm_train.metrics import table_peak_flops

    assert table_peak_flops(name, dtype, tf32=tf32) == expected


def test_every_row_of_the_peak_table_is_positive_and_ordered_as_tensor_cores_run() -> None:
    # On NVIDIA's tensor cores since Ampere, TF32 runs at half the bfloat16/float16 rate; plain float32 (CUDA
    # cores) is never faster than TF32 (equal on the GeForce cards, whose float16 is the float32-accumulate rate).
    # Every row is held to this, the rows the test above does not name too (a zero breaks it).
    from tlm_train.metrics import PEAK_TABLE

    assert len({name for _, name, _ in PEAK_TABLE}) == len(PEAK_TABLE)
    for _, name, (half, tf32, fp32) in PEAK_TABLE:
        assert 0 < fp32 <= tf32 and half == pytest.approx(2 * tf32, rel=0.03), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_on_a_cpu_the_peak_is_a_gemm_measured_in_the_training_dtype(monkeypatch, dtype) -> None:
    from tlm_train import metrics

    calls = []

    def mm(a, b):
        calls.append((a.dtype, b.dtype))
        return a

    monkeypatch.setattr(metrics.torch, "mm", mm)
    rate, source = metrics.peak_flops("cpu", dtype)
    assert rate > 0 and calls == [(getattr(torch, dtype),) * 2] * 6
    assert source == f"a 1024² {dtype} GEMM measured on this cpu at start-up"


def test_a_sigkilled_writer_leaves_whole_records_and_at_most_a_cut_last_line(tmp_path) -> None:
    import os
    import signal
    import time

    path = tmp_path / "m.jsonl"
    padding = "x" * (1 << 20)  # 1 MiB lines: a kill can land inside one write
    for kill_after in (1, 3, 6):
        path.unlink(missing_ok=True)
        pid = os.fork()
        if pid == 0:  # the child appends until it is killed
            try:
                log, step = MetricsLog(path), 0
                while True:
                    log.append({"step": step, "pad": padding})
                    step += 1
            finally:
                os._exit(1)
        deadline = time.monotonic() + 120
        while (not path.exists() or path.stat().st_size < kill_after << 20) and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(pid, signal.SIGKILL)
        assert os.waitpid(pid, 0)[1] == signal.SIGKILL
        records = MetricsLog(path).read()
        assert len(records) >= kill_after - 1
        assert [r["step"] for r in records] == list(range(len(records)))
        assert all(r["pad"] == padding for r in records)


def test_a_flipped_bit_before_the_last_line_is_an_error_not_a_silent_cut(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    log = MetricsLog(path)
    for step in range(4):
        log.append({"step": step, "train_loss": 1.0})
    data = bytearray(path.read_bytes())
    second = data.index(b"\n") + 1
    data[second] ^= 0x01  # line 2's "{" becomes "z"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"m\.jsonl: line 2 is not JSON .*the file is damaged, not cut by a kill"):
        log.read()
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        log.truncate(3)  # a resume stops rather than drop steps 1-3
    assert path.read_bytes() == bytes(data)
