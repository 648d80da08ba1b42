"""LoRA fine-tuning against full fine-tuning at a preset; writes its section of docs/benchmarks.md.

Usage: ``python bench/lora.py [--preset course-tinystories] [--rank 8] [--targets q,v] [--repeats N] [--quick]``
from the repository root, in any venv with torch and numpy.

Method. One process, one base model (the preset, built unfused as ``tlm train`` builds it, random weights). The
full fine-tune trains every parameter; the LoRA one is a copy of the same base with ``tlm_lora.apply_lora``
(every base weight frozen). Both run ``tlm_train.train_step`` (forward, chunked loss, backward, clipping, tlm's
AdamW) on the same fixed batch, timed alternately (full, LoRA, full, ...) after two warm-up steps each; the row
reports the medians and their ratio, so drift on a shared machine hits both alike. Trainable parameters are
counted, and optimizer-state bytes are measured: the bytes of every tensor in ``optimizer.state`` after a step
(AdamW's two moments per trainable parameter).
"""

import argparse
import copy
import datetime
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from _common import cpu_description, write_section

ROOT = pathlib.Path(__file__).resolve().parents[1]
try:
    import tlm_lora  # noqa: F401
except ImportError:  # run from a checkout: use the workspace sources
    sys.path.extend(str(p) for p in sorted(ROOT.glob("packages/*/src")))

from tlm_lora import apply_lora  # noqa: E402
from tlm_model import ModelConfig, TransformerLM  # noqa: E402
from tlm_optim import AdamW  # noqa: E402
from tlm_train import LanguageModelLoss, train_step  # noqa: E402
from tlm_train.distributed import parameter_groups  # noqa: E402


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


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    tensors = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(preset: str, rank: int, targets: str, batch: int, repeats: int, device: str) -> dict:
    torch.manual_seed(0)
    config = ModelConfig.from_preset(preset)
    full = TransformerLM(config, fused=False, device=device)
    lora = copy.deepcopy(full)
    apply_lora(lora, targets, rank=rank)
    ids = torch.randint(0, config.vocab_size, (batch, config.context_length + 1), device=device)
    batches = [(ids[:, :-1], ids[:, 1:])]
    runs = {}
    for name, model in (("full", full), ("lora", lora)):
        optimizer = AdamW(parameter_groups(model, 0.1), lr=1e-4)
        loss = LanguageModelLoss(model)
        runs[name] = (model, optimizer, loss)

    def step(name: str) -> Callable[[], None]:
        _, optimizer, loss = runs[name]

        def run() -> None:
            train_step(loss, optimizer, batches, max_grad_norm=1.0)
            if device != "cpu":
                torch.cuda.synchronize()

        return run

    full_s, lora_s = alternate(step("full"), step("lora"), repeats)
    out = {"full_s": full_s, "lora_s": lora_s}
    for name, (model, optimizer, _) in runs.items():
        out[f"{name}_trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out[f"{name}_optimizer_bytes"] = state_bytes(optimizer)
    out["parameters"] = full.num_parameters()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="course-tinystories")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q,v")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="the tiny preset, 2 repeats; prints, writes nothing")
    args = parser.parse_args()
    preset, repeats = ("tiny", 2) if args.quick else (args.preset, args.repeats)
    r = measure(preset, args.rank, args.targets, args.batch, repeats, args.device)
    ratio = r["lora_s"] / r["full_s"]
    rows = [
        "| | full fine-tuning | LoRA | LoRA / full |",
        "|---|---:|---:|---:|",
        f"| trainable parameters | {r['full_trainable']:,} | {r['lora_trainable']:,} | "
        f"{r['lora_trainable'] / r['full_trainable']:.4%} |",
        f"| AdamW state (bytes, measured) | {r['full_optimizer_bytes']:,} | {r['lora_optimizer_bytes']:,} | "
        f"{r['lora_optimizer_bytes'] / r['full_optimizer_bytes']:.4%} |",
        f"| step time (median of {repeats}, s) | {r['full_s']:.3f} | {r['lora_s']:.3f} | {ratio:.2f} |",
    ]
    machine = cpu_description() if args.device == "cpu" else torch.cuda.get_device_name()
    text = (
        f"## LoRA against full fine-tuning (`bench/lora.py`)\n\n"
        f"{preset} ({r['parameters']:,} parameters), LoRA rank {args.rank} on `{args.targets}`, one "
        f"{args.batch} × {ModelConfig.from_preset(preset).context_length} batch, `train_step` with tlm's AdamW, "
        f"float32 on {args.device} ({machine}; torch {torch.__version__}, Python {platform.python_version()}, "
        f"{torch.get_num_threads()} threads, {datetime.date.today().isoformat()}).\n\n" + "\n".join(rows) + "\n"
    )
    print(text)
    if not args.quick:
        write_section("lora", text)


if __name__ == "__main__":
    main()
