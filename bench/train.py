"""A training step: tlm against HF transformers' LlamaForCausalLM + torch.optim.AdamW(foreach=True),
same weights, same batches, one process.

    python bench/train.py [--quick] [--step MODULE:FUNCTION]   # writes its section of docs/benchmarks.md

Both steps do what a training step does: zero the gradients, forward, loss, backward, clip the
gradients' global norm to 1.0, the optimizer step, and read the loss and the norm back to the host
(what a logging step reads). tlm's step is :func:`recipe_step`, the one `tlm train` runs
(``tlm_train.train_step``: the chunked LM head and cross-entropy, ``tlm_optim.clip_grad_norm_``,
``tlm_optim.AdamW``), on the unfused layout that tlm-train trains; ``--step`` names any other function
of ``(model, optimizer, batch)`` to time in its place (``--step train:tlm_step``: the bare step).
HF computes its full logits and ``F.cross_entropy``, then
``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW(foreach=True)``.

Method. Every round runs each measured call once, in turn (tlm, HF, ...), after a warm-up; a ratio's
median and range are over the per-round ratios, so a burst of load on this shared machine moves both
sides of a round alike. The parts (forward + backward, clipping, optimizer step) are timed the same
way, each on the gradients the preceding forward + backward left. "Evaluation" is the loss of the
same batch under ``torch.no_grad()``. MFU is the training matmul FLOPs (3 × forward, causal
attention counted as half) per second over the float32 ``torch.mm`` rate measured in the same run.
"""

import argparse
import datetime
import importlib
import itertools
import pathlib
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from _common import alternate_times, cpu_description, gemm_rate, load_average, ratio_spread, write_section

from tlm_model import ModelConfig, TransformerLM
from tlm_model.accounting import account
from tlm_model.interop import hf_llama_config_kwargs, to_hf_llama_state_dict
from tlm_optim import AdamW, clip_grad_norm_

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The model `tlm train` trains when given no model options, at its default batch.
SMALL = ModelConfig(vocab_size=1024, context_length=128, d_model=128, num_layers=4, num_heads=4, d_ff=384)
COURSE = ModelConfig.from_preset("course-tinystories")
SHAPES = [
    ("default `tlm train` model (1.1 M params)", SMALL, 16),
    ("course-tinystories preset (22.7 M params)", COURSE, 4),
]
MAX_GRAD_NORM = 1.0
Batch = tuple[torch.Tensor, torch.Tensor]


def tlm_step(model: TransformerLM, optimizer: torch.optim.Optimizer, batch: Batch) -> dict[str, float]:
    """One tlm training step on ``batch`` = (inputs, targets)."""
    inputs, targets = batch
    optimizer.zero_grad(set_to_none=True)
    loss = model.loss(inputs, targets)
    loss.backward()
    grad_norm = clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    return {"loss": loss.item(), "grad_norm": grad_norm.item()}


_LOSS_MODULES: dict[int, Any] = {}


def recipe_step(model: TransformerLM, optimizer: torch.optim.Optimizer, batch: Batch) -> dict[str, float]:
    """The step `tlm train` runs: ``tlm_train.train_step`` over the loss module the recipe wraps the model in
    (forward, the chunked loss, backward, clipping, the optimizer step), then the host reads of a logging step."""
    from tlm_train import LanguageModelLoss, train_step

    loss_module = _LOSS_MODULES.setdefault(id(model), LanguageModelLoss(model))
    stats = train_step(loss_module, optimizer, [batch], max_grad_norm=MAX_GRAD_NORM)
    return {"loss": float(stats.loss), "grad_norm": float(stats.grad_norm)}


def hf_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), targets.flatten())


def hf_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> dict[str, float]:
    """The reference: what an HF training loop does per step."""
    optimizer.zero_grad(set_to_none=True)
    loss = hf_loss(model, batch)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    return {"loss": loss.item(), "grad_norm": grad_norm.item()}


def batches(cfg: ModelConfig, batch: int, count: int = 8, seed: int = 0) -> list[Batch]:
    """``count`` (inputs, targets) pairs of consecutive tokens from one random token stream."""
    rng = np.random.default_rng(seed)
    tokens = torch.from_numpy(rng.integers(0, cfg.vocab_size, 100_000))
    out = []
    for _ in range(count):
        starts = torch.from_numpy(rng.integers(0, len(tokens) - cfg.context_length - 1, batch))
        rows = torch.stack([tokens[s : s + cfg.context_length + 1] for s in starts.tolist()])
        out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return out


def compare(cfg: ModelConfig, batch: int, repeats: int, rate: float, step: Callable[..., Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    ours = TransformerLM(cfg, fused=False)  # the layout tlm-train trains
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**hf_llama_config_kwargs(cfg), attn_implementation="sdpa")
    )
    hf.load_state_dict(to_hf_llama_state_dict(ours.state_dict(), cfg))
    optimizer = AdamW(ours.parameters(), lr=1e-4, weight_decay=0.1)
    hf_optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    data = batches(cfg, batch)
    with torch.no_grad():  # the same model: the same loss on the same batch
        torch.testing.assert_close(ours.loss(*data[0]), hf_loss(hf, data[0]), rtol=1e-4, atol=1e-4)

    cycles = {name: itertools.cycle(data) for name in ("tlm", "hf")}
    parts = {name: itertools.cycle(data) for name in ("tlm", "hf")}

    def tlm_forward_backward() -> None:
        ours.zero_grad(set_to_none=True)
        ours.loss(*next(parts["tlm"])).backward()

    def hf_forward_backward() -> None:
        hf.zero_grad(set_to_none=True)
        hf_loss(hf, next(parts["hf"])).backward()

    def tlm_eval() -> None:
        with torch.no_grad():
            ours.loss(*data[0]).item()

    def hf_eval() -> None:
        with torch.no_grad():
            hf_loss(hf, data[0]).item()

    fns: dict[str, Callable[[], object]] = {
        "tlm_step": lambda: step(ours, optimizer, next(cycles["tlm"])),
        "hf_step": lambda: hf_step(hf, hf_optimizer, next(cycles["hf"])),
        "tlm_fb": tlm_forward_backward,
        "tlm_clip": lambda: clip_grad_norm_(ours.parameters(), MAX_GRAD_NORM),
        "tlm_opt": optimizer.step,
        "hf_fb": hf_forward_backward,
        "hf_clip": lambda: torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_GRAD_NORM),
        "hf_opt": hf_optimizer.step,
        "tlm_eval": tlm_eval,
        "hf_eval": hf_eval,
    }
    load_before = load_average()
    t = alternate_times(fns, repeats, warmup=2)
    median = {name: statistics.median(ts) for name, ts in t.items()}
    tokens = batch * cfg.context_length
    return {
        "median_s": median,
        "ratio": {part: ratio_spread(t[f"hf_{part}"], t[f"tlm_{part}"]) for part in ("step", "fb", "clip", "opt")},
        # Evaluation's cost as a share of a training forward + backward on the same model and batch.
        "eval_share": {side: ratio_spread(t[f"{side}_eval"], t[f"{side}_fb"]) for side in ("tlm", "hf")},
        "tokens_per_s": tokens / median["tlm_step"],
        "mfu": 3 * account(cfg, batch, cfg.context_length).forward_flops_causal / median["tlm_step"] / rate,
        "load": (load_before, load_average()),
    }


def profile_forward_backward(cfg: ModelConfig, batch: int, top: int = 6) -> dict[str, dict[str, float]]:
    """Each side's largest shares of forward + backward CPU time (torch.profiler, self time)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    ours = TransformerLM(cfg, fused=False)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**hf_llama_config_kwargs(cfg), attn_implementation="sdpa")
    )
    data = batches(cfg, batch, count=1)[0]
    runs = {"tlm": lambda: ours.loss(*data).backward(), "hf": lambda: hf_loss(hf, data).backward()}
    shares = {}
    for name, run in runs.items():
        run()  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events)
        shares[name] = {e.key: e.self_cpu_time_total / total for e in events[:top]}
    return shares


def render(rows: list[tuple[str, int, dict[str, Any]]], profile: dict[str, dict[str, float]], meta: dict) -> str:
    def ratio(r: tuple[float, float, float]) -> str:
        return f"**{r[0]:.2f}×** ({r[1]:.2f}–{r[2]:.2f})"

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:,.1f} ms" if seconds < 0.1 else f"{seconds * 1e3:,.0f} ms"

    lines = [
        "# Training step: tlm vs HF Llama + torch AdamW(foreach)",
        "",
        f"Written by `python bench/train.py` on {meta['date']}; CPU: {meta['cpu']}; torch {meta['torch']}, "
        f"transformers {meta['transformers']}, {meta['threads']} threads, float32. Float32 GEMM rate (2048³ "
        f"`torch.mm`, this run): {meta['gemm_gflops']:.0f} GFLOP/s. tlm's step: `{meta['step']}`. "
        f"{meta['repeats']} rounds per row; ratio = HF time ÷ tlm time (above 1: tlm faster), the median "
        "over rounds and, in brackets, the lowest and highest round. Load average (1 min) before / after "
        "each row is given: this machine is shared, so times move with it, and same-round ratios much less.",
        "",
        "| workload | tlm step | HF step | HF ÷ tlm | tlm tokens/s | MFU | load |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, batch, r in rows:
        m = r["median_s"]
        lines.append(
            f"| {label}, {batch} × {meta['seq'][label]} | {ms(m['tlm_step'])} | {ms(m['hf_step'])} | "
            f"{ratio(r['ratio']['step'])} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.0f}% | "
            f"{r['load'][0]:.1f} / {r['load'][1]:.1f} |"
        )
    lines += [
        "",
        "Where the step's time goes, part by part (medians; ratio = HF ÷ tlm):",
        "",
        "| workload | part | tlm | HF | HF ÷ tlm |",
        "|---|---|---:|---:|---:|",
    ]
    names = {"fb": "forward + backward (loss)", "clip": "clip the gradients' norm", "opt": "AdamW step"}
    for label, _, r in rows:
        for part, name in names.items():
            m = r["median_s"]
            lines.append(
                f"| {label} | {name} | {ms(m[f'tlm_{part}'])} | {ms(m[f'hf_{part}'])} | {ratio(r['ratio'][part])} |"
            )
    lines += [
        "",
        "Evaluation (the loss of the same batch under `torch.no_grad()`) against a training forward + backward "
        "on the same model and batch (time of evaluation ÷ time of forward + backward; lower is cheaper):",
        "",
        "| workload | tlm evaluation | tlm eval ÷ forward + backward | HF evaluation | HF eval ÷ forward + backward |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, _, r in rows:
        m, share = r["median_s"], r["eval_share"]
        lines.append(
            f"| {label} | {ms(m['tlm_eval'])} | {share['tlm'][0]:.2f} ({share['tlm'][1]:.2f}–{share['tlm'][2]:.2f}) | "
            f"{ms(m['hf_eval'])} | {share['hf'][0]:.2f} ({share['hf'][1]:.2f}–{share['hf'][2]:.2f}) |"
        )
    lines += [
        "",
        f"Forward + backward of the {profile['label']}, by torch.profiler self time: "
        + "; ".join(
            f"{side}: " + ", ".join(f"`{op}` {100 * share:.0f}%" for op, share in profile[side].items())
            for side in ("tlm", "hf")
        )
        + ".",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, the default model only, print only")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--step", help="MODULE:FUNCTION of (model, optimizer, batch) to time as tlm's step")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    step, step_name = recipe_step, "tlm_train.train_step (bench/train.py:recipe_step)"
    if args.step:
        module, _, name = args.step.partition(":")
        step, step_name = getattr(importlib.import_module(module), name), args.step
    repeats = 3 if args.quick else args.repeats
    rate = gemm_rate()
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = []
    for label, cfg, batch in shapes:
        rows.append((label, batch, compare(cfg, batch, repeats, rate, step)))
        print(f"{label}: {rows[-1][2]}", file=sys.stderr, flush=True)
    profile = {"label": SHAPES[0][0], **profile_forward_backward(SHAPES[0][1], SHAPES[0][2])}
    meta = {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "gemm_gflops": rate / 1e9,
        "step": step_name,
        "repeats": repeats,
        "seq": {label: cfg.context_length for label, cfg, _ in SHAPES},
    }
    text = render(rows, profile, meta)
    print(text)
    if not args.quick:
        write_section("train", text, args.out)


if __name__ == "__main__":
    main()
