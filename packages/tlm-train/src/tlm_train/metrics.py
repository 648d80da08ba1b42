"""What a run records: ``metrics.jsonl`` (one JSON object per logged step), the loss-curve PNG,
and the model-FLOP utilisation (MFU): the training FLOPs per second over the device's dense peak for the
training dtype (:func:`peak_flops`: a table of published peaks for common accelerators, else a GEMM in
that dtype measured on the same machine)."""

import contextlib
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from tlm_core.atomic import atomic_write, read_input
from tlm_model import ModelConfig
from tlm_model.accounting import account

#: Fields that measure the machine, not the run: they differ between a run and its resumed twin.
TIMING_FIELDS = ("tokens_per_s", "mfu", "time_s")


class MetricsLog:
    """Appends one JSON line per record to ``path``; :meth:`truncate` drops records past a step,
    which a resumed run calls so that the file reads as if the run had never stopped."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        # One write of one whole line: a kill leaves at most a cut last line, which read() drops.
        with open(self.path, "a", encoding="utf-8", opener=_no_follow) as file:
            file.write(json.dumps(record, allow_nan=True) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        *lines, last = read_input(self.path, "metrics log").decode("utf-8").split("\n")
        records = []
        for number, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:  # a kill cuts only the last line, the one without its newline
                raise ValueError(
                    f"{self.path}: line {number} is not JSON ({err.msg}), and lines follow it: the file is damaged, "
                    "not cut by a kill; restore it, or delete the line to keep the records after it"
                ) from None
        if last:  # a last line without its newline: a kill cut it short, unless its JSON is whole
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(last))
        return records

    def truncate(self, step: int) -> None:
        """Keep only the records of steps <= ``step`` (written all-or-nothing). A negative ``step`` (a new run) keeps
        none and reads nothing: whatever was at the path, even a symlink to a user's file, is replaced unread."""
        kept = [] if step < 0 else [r for r in self.read() if isinstance(r, dict) and r.get("step", step + 1) <= step]
        atomic_write(self.path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in kept))


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)  # a planted symlink is an error, never followed


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Matmul FLOPs of forward + backward per trained token (3 × forward, causal attention)."""
    report = account(config, batch_size=1, seq_len=seq_len)
    return 3 * report.forward_flops_causal / report.tokens


#: Dense (no 2:4 sparsity) peak tensor FLOP/s from the vendors' datasheets, by the name
#: ``torch.cuda.get_device_name`` gives (matched in order, first hit wins): (bfloat16/float16 with float32
#: accumulation, TF32, plain float32). GeForce cards are given at their float32-accumulate rate, which is
#: half their float16-accumulate one.
PEAK_TABLE: tuple[tuple[str, str, tuple[float, float, float]], ...] = (
    (r"H200 NVL", "NVIDIA H200 NVL", (835e12, 417.5e12, 60e12)),
    (r"H200", "NVIDIA H200 SXM", (989.4e12, 494.7e12, 66.9e12)),
    (r"H100 NVL", "NVIDIA H100 NVL", (835e12, 417.5e12, 60e12)),
    (r"H100.*PCIe", "NVIDIA H100 PCIe", (756e12, 378e12, 51.2e12)),
    (r"H100", "NVIDIA H100 SXM", (989.4e12, 494.7e12, 66.9e12)),
    (r"GH200", "NVIDIA GH200", (989.4e12, 494.7e12, 66.9e12)),
    (r"A100", "NVIDIA A100", (312e12, 156e12, 19.5e12)),
    (r"L40S", "NVIDIA L40S", (362.05e12, 183.2e12, 91.6e12)),
    (r"\bL4\b", "NVIDIA L4", (121e12, 60e12, 30.3e12)),
    (r"\bA10\b", "NVIDIA A10", (125e12, 62.5e12, 31.2e12)),
    (r"RTX A6000", "NVIDIA RTX A6000", (154.8e12, 77.4e12, 38.7e12)),
    (r"RTX 4090", "NVIDIA GeForce RTX 4090", (165.2e12, 82.6e12, 82.6e12)),
    (r"RTX 4080", "NVIDIA GeForce RTX 4080", (97.5e12, 48.7e12, 48.7e12)),
    (r"RTX 3090", "NVIDIA GeForce RTX 3090", (71e12, 35.6e12, 35.6e12)),
    (r"RTX 3080", "NVIDIA GeForce RTX 3080", (59.5e12, 29.8e12, 29.8e12)),
)


def table_peak_flops(device_name: str, dtype: str, *, tf32: bool = True) -> tuple[float, str] | None:
    """The published dense peak of the accelerator ``device_name`` for training in ``dtype`` (float32 runs
    at the TF32 rate when ``tf32``), and the table's name for it; None for a device not in :data:`PEAK_TABLE`."""
    for pattern, name, (half, tf32_rate, fp32) in PEAK_TABLE:
        if re.search(pattern, device_name):
            if dtype in ("bfloat16", "float16"):
                return half, f"{name}, {dtype} dense peak"
            if dtype == "float32":
                return (tf32_rate, f"{name}, TF32 dense peak") if tf32 else (fp32, f"{name}, float32 peak")
            return None
    return None


def peak_flops(device: torch.device | str, dtype: str = "float32", *, tf32: bool = True) -> tuple[float, str]:
    """MFU's denominator: the FLOP/s the device can reach in the training ``dtype``, and where it comes
    from. A CUDA device in :data:`PEAK_TABLE` gets its published dense peak; any other device a square
    GEMM in ``dtype`` measured now (on a CPU the reachable rate depends on the chip and the library)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = table_peak_flops(name, dtype, tf32=tf32)
        if found is not None:
            return found
        measured = measure_gemm_flops(device, size=4096, dtype=getattr(torch, dtype))
        return measured, f"{name} is not in tlm's table: a 4096² {dtype} GEMM measured at start-up"
    measured = measure_gemm_flops(device, dtype=getattr(torch, dtype))
    return measured, f"a 1024² {dtype} GEMM measured on this {device.type} at start-up"


def measure_gemm_flops(
    device: torch.device | str = "cpu", size: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32
) -> float:
    """FLOP/s of a square ``dtype`` matmul on ``device`` (best of ``repeats``): MFU's denominator where no
    published peak applies, measured in the run itself."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = math.inf
    for _ in range(repeats + 1):  # the first call warms up the library
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def plot_loss_curve(metrics_path: str | os.PathLike[str], png_path: str | os.PathLike[str]) -> Path | None:
    """Draw train and validation loss against step; ``None`` (nothing written) without matplotlib. Each
    evaluation is a marker with no line between them: with evaluations far apart, a line would draw a
    validation curve that no evaluation measured."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = MetricsLog(metrics_path).read()
    train = [(r["step"], r["train_loss"]) for r in records if r.get("train_loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o", linestyle="none", label="validation (each evaluation)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    atomic_write(png_path, lambda file: fig.savefig(file, format="png"))
    plt.close(fig)
    return png_path
