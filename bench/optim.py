"""tlm-optim's AdamW against torch's, and get_batch against a training step; writes its section of docs/benchmarks.md.

Usage: ``python bench/optim.py [--repeats N] [--quick]`` from the repository root, in any venv with
torch and numpy (the workspace's ``packages/*/src`` are put on the path when tlm is not installed).

Method. Ratios only, measured in one process: each optimizer row times ``AdamW.step()`` of
tlm_optim against ``torch.optim.AdamW`` (``foreach=True``, then ``fused=True``) on the parameters
of a preset built with ``TransformerLM.from_preset`` and fixed random gradients. The two optimizers
of a pair share the parameters and gradients, hold their own state, and are timed alternately
(ours, theirs, ours, ...) after two warm-up steps each; a row reports the medians and the ratio of
medians, so drift on this shared machine hits both alike. The get_batch row times ``get_batch``
from a uint16 ``np.memmap`` of random tokens against one training step of the course preset
(forward, cross-entropy, backward, clipping, AdamW) on the same batch shape, again alternating.
"""

import argparse
import datetime
import gc
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
from _common import cpu_description, write_section

ROOT = pathlib.Path(__file__).resolve().parents[1]
try:
    import tlm_train  # noqa: F401
except ImportError:  # run from a checkout: use the workspace sources
    sys.path.extend(str(p) for p in sorted(ROOT.glob("packages/*/src")))

from tlm_model import TransformerLM, cross_entropy  # noqa: E402
from tlm_optim import AdamW, clip_grad_norm_  # noqa: E402
from tlm_train import get_batch  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"


def alternate(a: Callable[[], None], b: Callable[[], None], repeats: int, warmup: int = 2) -> tuple[float, float]:
    """Median seconds of ``a`` and of ``b``, timed alternately after ``warmup`` calls of each."""
    for _ in range(warmup):
        a()
        b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((a, times[0]), (b, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def optimizer_rows(preset: str, repeats: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    model = TransformerLM.from_preset(preset)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    count = sum(p.numel() for p in params)
    rows = []
    pairs = (
        ("default", {}, "foreach=True", {"foreach": True}),
        ("default", {}, "fused=True", {"fused": True}),
        ("fused=False (multi-tensor)", {"fused": False}, "foreach=True", {"foreach": True}),
    )
    for our_label, our_kwargs, label, kwargs in pairs:
        ours = AdamW(params, lr=1e-5, weight_decay=0.01, **our_kwargs)
        try:
            theirs = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, **kwargs)
        except (RuntimeError, ValueError) as error:  # fused is not offered for every device/dtype
            print(f"skipping torch AdamW({label}): {error}", file=sys.stderr)
            continue
        t_ours, t_theirs = alternate(ours.step, theirs.step, repeats)
        rows.append(
            (f"AdamW({our_label}).step, {preset} ({count / 1e6:.1f}M params) vs torch AdamW({label})", t_ours, t_theirs)
        )
        del ours, theirs
        gc.collect()
    return rows


def get_batch_row(repeats: int, batch: int) -> tuple[str, float, float]:
    torch.manual_seed(0)
    model = TransformerLM.from_preset("course-tinystories")
    context, vocab = model.config.context_length, model.config.vocab_size
    opt = AdamW(model.parameters(), lr=1e-4)
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "tokens.bin"
        n = 20_000_000  # 40 MB of uint16 ids
        np.random.default_rng(0).integers(0, vocab, size=n, dtype=np.uint16).tofile(path)
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        gen = torch.Generator().manual_seed(0)
        x, y = get_batch(tokens, batch, context, "cpu", generator=gen)

        def step() -> None:
            loss = cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        def draw() -> None:
            # Many draws per timing so the (tiny) time is above the clock's noise; reported per batch.
            for _ in range(50):
                get_batch(tokens, batch, context, "cpu", generator=gen)

        t_draw, t_step = alternate(draw, step, repeats)
    return f"get_batch (memmap uint16, {batch} × {context}) vs a course-preset training step", t_draw / 50, t_step


def render(rows: list[tuple[str, float, float]], repeats: int) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# tlm-optim and tlm-train benchmarks",
        "",
        f"Written by `python bench/optim.py` on {now}. CPU: {cpu_description()}, {torch.get_num_threads()} torch "
        f"threads, torch {torch.__version__}, Python {platform.python_version()}. Medians of {repeats} "
        "alternating repeats; ratio = ours ÷ reference (below 1.00× is faster for the optimizer rows; "
        "for get_batch it is the share of a training step). The machine is shared, so expect a few "
        "percent of run-to-run noise.",
        "",
        "| workload | ours (ms) | reference (ms) | ratio |",
        "|---|---:|---:|---:|",
    ]
    for label, ours, ref in rows:
        ratio = f"{100 * ours / ref:.4f}% of a step" if label.startswith("get_batch") else f"{ours / ref:.3f}×"
        lines.append(f"| {label} | {ours * 1e3:.3f} | {ref * 1e3:.1f} | {ratio} |")
    lines += [
        "",
        "Targets (issue 11): AdamW.step ≤ 1.0× torch `foreach=True`, within 1.2× of `fused=True`; "
        "get_batch ≤ 2% of a course-preset training step.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's); 1 is steadier on a busy machine"
    )
    parser.add_argument("--quick", action="store_true", help="course preset only, 3 repeats, no doc written")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = optimizer_rows("course-tinystories", repeats)
    if not args.quick:
        rows += optimizer_rows("gpt2-small", repeats)
    rows.append(get_batch_row(repeats, batch=4))
    text = render(rows, repeats)
    print(text)
    if not args.quick:
        write_section("optim", text, DOC)
        print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
