"""bfloat16 training on this CPU: tlm under ``--dtype bfloat16`` against HF Llama under the same autocast,
and against tlm's own float32 step; same weights, same batches, alternating in one process.

    python bench/bf16.py [--quick] [--rounds N] [--compile] [--shapes course,gpt2]   # writes its doc section

Every side runs a whole training step (zero the gradients, forward, loss, backward, clip to 1.0, AdamW, and
the host read a logging step makes). tlm: ``tlm_train.train_step`` with ``autocast_dtype`` (the step
``tlm train --dtype bfloat16`` runs; float32: without it), ``tlm_optim.AdamW``. HF: ``LlamaForCausalLM``
(sdpa) under ``torch.autocast("cpu", torch.bfloat16)``, its full logits in float32 into ``F.cross_entropy``,
``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW(foreach=True)``. ``--compile`` adds tlm's blocks
compiled in place (the recipe's ``--compile``) against ``torch.compile(hf)``. A ratio's median and range are
over the per-round ratios (speed = the reference's time ÷ tlm's), rounds running each side once in turn.

The census column is the share of the step's GEMM FLOPs (forward + backward) that run in float32 under
bfloat16 autocast, counted per call with a ``TorchDispatchMode`` (``torch.utils.flop_counter`` formulas).
"""

import argparse
import datetime
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from _common import cpu_description, load_average, ratio_spread, write_section
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from tlm_model import ModelConfig, TransformerLM
from tlm_model.interop import hf_llama_config_kwargs, to_hf_llama_state_dict
from tlm_optim import AdamW
from tlm_train import NonFiniteGuard, train_step, wrap_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPES = {
    "course": ("course-tinystories preset (22.7 M), 4 × 256", ModelConfig.from_preset("course-tinystories"), 4),
    "gpt2": ("GPT-2-small-like (124 M), 1 × 512", ModelConfig(50_257, 512, 768, 12, 12, 2048), 1),
}
aten = torch.ops.aten
#: --cpu-time: the process's CPU seconds per step on one thread instead of wall time (a busy shared machine
#: stretches wall time by whatever else runs; the CPU time a step takes is its own work).
CPU_TIME = False
_GEMMS = {aten.mm, aten.addmm, aten.addmm_, aten.bmm, aten.baddbmm}


class GemmCensus(TorchDispatchMode):
    """FLOPs of every matrix product, by the dtype it runs in."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _GEMMS:
            formula = flop_registry[aten.addmm if packet is aten.addmm_ else packet]
            operand = args[1] if packet in (aten.addmm, aten.addmm_, aten.baddbmm) else args[0]
            key = str(operand.dtype).removeprefix("torch.")
            self.flops[key] = self.flops.get(key, 0) + formula(*args, **kwargs, out_val=out)
        return out


def fp32_share(fn: Callable[[], object]) -> float:
    with GemmCensus() as census:
        fn()
    return census.flops.get("float32", 0) / sum(census.flops.values())


def build(cfg: ModelConfig, batch: int, compile_: bool) -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    ours = TransformerLM(cfg, fused=False)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**hf_llama_config_kwargs(cfg), attn_implementation="sdpa")
    )
    hf.load_state_dict(to_hf_llama_state_dict(ours.state_dict(), cfg))
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, cfg.vocab_size, (4, batch, cfg.context_length + 1), generator=gen)
    data = [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]
    count = {"i": 0}

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        count["i"] += 1
        return data[count["i"] % len(data)]

    tlm_module = wrap_model(ours, "none")
    tlm_opt = AdamW(ours.parameters(), lr=1e-4, weight_decay=0.1)
    guard = NonFiniteGuard("cpu")

    def tlm(dtype: torch.dtype | None, module: torch.nn.Module = tlm_module) -> Callable[[], object]:
        def step() -> object:
            stats = train_step(module, tlm_opt, [next_batch()], max_grad_norm=1.0, autocast_dtype=dtype, guard=guard)
            return float(stats.loss), float(stats.grad_norm)

        return step

    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    def hf_step(model: torch.nn.Module) -> Callable[[], object]:
        def step() -> object:
            inputs, targets = next_batch()
            hf_opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=inputs).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
            hf_opt.step()
            return float(loss.detach()), float(norm)

        return step

    fns = {"tlm_bf16": tlm(torch.bfloat16), "tlm_fp32": tlm(None), "hf_bf16": hf_step(hf)}
    if compile_:
        compiled = TransformerLM(cfg, fused=False)
        compiled.load_state_dict(ours.state_dict())
        module = wrap_model(compiled, "none", compile=True)
        opt_c = AdamW(compiled.parameters(), lr=1e-4, weight_decay=0.1)
        guard_c = NonFiniteGuard("cpu")

        def tlm_compiled() -> object:
            stats = train_step(module, opt_c, [next_batch()], max_grad_norm=1.0, autocast_dtype=torch.bfloat16,
                               guard=guard_c)  # fmt: skip
            return float(stats.loss), float(stats.grad_norm)

        fns["tlm_bf16_compiled"] = tlm_compiled
        fns["hf_bf16_compiled"] = hf_step(torch.compile(hf))
    return {"fns": fns, "ours": ours, "hf": hf, "data": data}


def census(cfg: ModelConfig, built: dict[str, Any]) -> dict[str, float]:
    ours, hf, (inputs, targets) = built["ours"], built["hf"], built["data"][0]

    def tlm() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ours.loss(inputs, targets)
        loss.backward()

    def ref() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = hf(input_ids=inputs).logits
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()

    shares = {"tlm": fp32_share(tlm), "hf": fp32_share(ref)}
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    return shares


def measure(key: str, rounds: int, compile_: bool) -> dict[str, Any]:
    label, cfg, batch = SHAPES[key]
    built = build(cfg, batch, compile_)
    fns = built["fns"]
    shares = census(cfg, built)
    warm = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        for _ in range(2 if "compiled" in name else 1):  # compiled: the forward and backward graphs, then a run
            fn()
        warm[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in fns}
    clock = time.process_time if CPU_TIME else time.perf_counter
    for _ in range(rounds):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    row: dict[str, Any] = {"label": label, "census_fp32_share": shares, "warmup_s": warm,
                           "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
                           "vs_hf_bf16": ratio_spread(times["hf_bf16"], times["tlm_bf16"]),
                           "vs_tlm_fp32": ratio_spread(times["tlm_fp32"], times["tlm_bf16"]),
                           "hf_bf16_vs_fp32_tlm": ratio_spread(times["tlm_fp32"], times["hf_bf16"])}  # fmt: skip
    if compile_:
        row["compiled_vs_hf_compiled"] = ratio_spread(times["hf_bf16_compiled"], times["tlm_bf16_compiled"])
        row["compiled_vs_eager"] = ratio_spread(times["tlm_bf16"], times["tlm_bf16_compiled"])
    return row


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def r(x: tuple[float, float, float]) -> str:
        return f"**{x[0]:.2f}×** ({x[1]:.2f}–{x[2]:.2f})"

    lines = [
        "## bfloat16 training on this CPU: tlm vs HF Llama under the same autocast",
        "",
        f"Measured {meta['date']} on {meta['cpu']}; torch {meta['torch']}, transformers {meta['transformers']}, "
        f"{meta['threads']} threads, {meta['rounds']} alternating rounds, {meta['clock']}. **The machine was shared "
        "and busy** "
        f"(1-minute load average {meta['load_before']:.1f} before, {meta['load_after']:.1f} after, on "
        f"{meta['cores']} cores): read the ranges, not only the medians. Speed = the reference's step time ÷ "
        "tlm's bf16 step time, per round.",
        "",
        "| shape | tlm bf16 ms | tlm fp32 ms | HF bf16 ms | tlm bf16 vs HF bf16 | tlm bf16 vs tlm fp32 | "
        "fp32 GEMM FLOPs under bf16: tlm / HF |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        ms, share = row["ms"], row["census_fp32_share"]
        lines.append(
            f"| {row['label']} | {ms['tlm_bf16']:,.0f} | {ms['tlm_fp32']:,.0f} | {ms['hf_bf16']:,.0f} | "
            f"{r(row['vs_hf_bf16'])} | {r(row['vs_tlm_fp32'])} | {100 * share['tlm']:.1f}% / {100 * share['hf']:.1f}% |"
        )
    lines += [
        "",
        "Before issue 33 (the chunked head of commit e24375e, whose `out=` and `addmm_` GEMMs autocast left in "
        "float32), by this script with the same method on 2026-12-04, course preset: tlm bf16 **0.95×** "
        "(0.94–0.97) HF bf16 and **1.91×** (1.89–1.94) tlm fp32, with 19.4% of the step's GEMM FLOPs in float32.",
        "",
        "Where the rest goes: the parts that stay float32 by design (AdamW's update of the float32 master weights "
        "and moments, the softmax and loss of each chunk, the head's float32 gradient sum, RMSNorm) cost the same "
        "in both precisions and cap tlm's bf16 ÷ fp32 ratio. At GPT-2 small's size AdamW's step and the clipping "
        "took 0.14 s of CPU per step on one thread (measured apart, 2026-12-04), about 6% of the bf16 step.",
    ]
    compiled = [row for row in rows if "compiled_vs_hf_compiled" in row]
    if compiled:
        lines += ["", "Compiled (tlm: each block compiled in place, the recipe's `--compile`; HF: `torch.compile`):",
                  "", "| shape | tlm bf16 compiled ms | HF bf16 compiled ms | tlm vs HF, compiled | tlm compiled vs "
                  "eager |", "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for row in compiled:
            ms = row["ms"]
            lines.append(
                f"| {row['label']} | {ms['tlm_bf16_compiled']:,.0f} | {ms['hf_bf16_compiled']:,.0f} | "
                f"{r(row['compiled_vs_hf_compiled'])} | {r(row['compiled_vs_eager'])} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", default="course,gpt2")
    parser.add_argument("--compile", action="store_true", help="add the compiled rows (first shape)")
    parser.add_argument("--quick", action="store_true", help="3 rounds, the course shape, print only")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, CPU seconds per step (busy machines)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    global CPU_TIME
    CPU_TIME = args.cpu_time
    if CPU_TIME:
        torch.set_num_threads(1)
    keys = ["course"] if args.quick else args.shapes.split(",")
    load_before = load_average()
    rows = []
    for i, key in enumerate(keys):
        row = measure(key, rounds, args.compile and i == 0)  # compiled rows: the first shape only (compile time)
        print(row, flush=True)
        rows.append(row)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_description(), "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "rounds": rounds, "cores": len(os.sched_getaffinity(0)),
        "load_before": load_before, "load_after": load_average(),
        "clock": "CPU seconds per step (process time)" if CPU_TIME else "wall time per step",
    }  # fmt: skip
    text = render(rows, meta)
    print(text)
    if not args.quick:
        write_section("bf16", text, args.out)


if __name__ == "__main__":
    sys.exit(main())
