"""What a run records: ``metrics.jsonl`` (one JSON object per logged step), the loss-curve PNG,
and the model-FLOP utilisation (MFU) against a GEMM rate measured on the same machine."""

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from tlm_core.atomic import atomic_write
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
        records = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut short by a kill: nothing after it was written either
        return records

    def truncate(self, step: int) -> None:
        """Keep only the records of steps <= ``step`` (written all-or-nothing)."""
        kept = [r for r in self.read() if isinstance(r, dict) and r.get("step", step + 1) <= step]
        atomic_write(self.path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in kept))


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)  # a planted symlink is an error, never followed


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Matmul FLOPs of forward + backward per trained token (3 × forward, causal attention)."""
    report = account(config, batch_size=1, seq_len=seq_len)
    return 3 * report.forward_flops_causal / report.tokens


def measure_gemm_flops(device: torch.device | str = "cpu", size: int = 1024, repeats: int = 5) -> float:
    """Float32 FLOP/s of a square matmul on ``device`` (best of ``repeats``): the denominator of MFU,
    measured in the run itself because a CPU's reachable rate depends on the chip and the library."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
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
