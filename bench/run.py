"""tlm against HF transformers' LlamaForCausalLM: same architecture, same weights, one process.

Run through ``nox -s bench`` (which installs transformers, a bench-only dependency) to write
docs/benchmarks.md; ``python bench/run.py --quick`` is a fast smoke run that prints the table.

Method. Both models hold identical weights (tlm's, converted by ``tlm_model.interop``; the logits
are checked to agree before timing). Each timing is the median of alternating repeats (tlm, HF,
tlm, HF, ...) after a warm-up, so drift on the machine hits both alike. Throughput is tokens per
second; "GEMM %" is the model's matmul FLOPs (causal attention counted as half, from
``tlm_model.accounting``; ×3 for forward+backward) per second over the float32 matmul rate this
machine reaches on a 2048³ product in the same run. Memory is peak resident set size above the
RSS just before the measured call (so the two libraries' different import footprints do not
count), measured in a fresh subprocess per run with the kernel's high-water mark reset.
"""

import argparse
import datetime
import gc
import json
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import transformers
from _common import alternate, alternate_times, cpu_description, gemm_rate, load_average, ratio_spread, write_section

from tlm_model import ModelConfig, TransformerBlock, TransformerLM, compile_for_inference, generate
from tlm_model.accounting import account
from tlm_model.interop import hf_llama_config_kwargs, to_hf_llama_state_dict

ROOT = pathlib.Path(__file__).resolve().parents[1]
COURSE = ModelConfig.from_preset("course-tinystories")
SMALL = ModelConfig(vocab_size=50_257, context_length=1024, d_model=768, num_layers=12, num_heads=12, d_ff=2048)
XL_BLOCK = ModelConfig(vocab_size=8, context_length=16_384, d_model=1600, num_layers=1, num_heads=25, d_ff=6400)


# --- building the two models -------------------------------------------------------------------


def build_pair(cfg: ModelConfig, seed: int = 0, **tlm_kwargs) -> tuple[TransformerLM, torch.nn.Module]:
    torch.manual_seed(seed)
    ours = TransformerLM(cfg, **tlm_kwargs)
    with torch.no_grad():  # non-trivial norm gains, so a layout mistake cannot hide behind ones
        for name, p in ours.named_parameters():
            if "ln" in name:
                p.uniform_(0.5, 1.5)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**hf_llama_config_kwargs(cfg), attn_implementation="sdpa")
    )
    hf.load_state_dict(to_hf_llama_state_dict(ours.state_dict(), cfg))
    ids = torch.randint(0, cfg.vocab_size, (1, min(cfg.context_length, 64)))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)
    return ours, hf


def block_pair(cfg: ModelConfig, seed: int = 0) -> tuple[Callable, Callable]:
    """One decoder layer each: tlm's TransformerBlock and a one-layer HF LlamaModel (its final
    norm replaced by the identity) fed through inputs_embeds."""
    torch.manual_seed(seed)
    block = TransformerBlock(cfg, fused=True)
    hf = transformers.LlamaModel(transformers.LlamaConfig(**hf_llama_config_kwargs(cfg), attn_implementation="sdpa"))
    hf.norm = torch.nn.Identity()
    sd = {f"layers.0.{k}": v for k, v in block.state_dict().items()}
    sd |= {"token_embeddings.weight": torch.zeros(cfg.vocab_size, cfg.d_model), "lm_head.weight": torch.zeros(1)}
    sd["ln_final.weight"] = torch.ones(cfg.d_model)
    hf_sd = {k.removeprefix("model."): v for k, v in to_hf_llama_state_dict(sd, cfg).items() if k != "lm_head.weight"}
    hf.load_state_dict({k: v for k, v in hf_sd.items() if k != "norm.weight"}, strict=False)
    x = torch.randn(1, 64, cfg.d_model)
    with torch.no_grad():
        torch.testing.assert_close(block(x), hf(inputs_embeds=x).last_hidden_state, rtol=1e-4, atol=1e-4)
    return (lambda x: block(x)), (lambda x: hf(inputs_embeds=x).last_hidden_state)


# --- measuring --------------------------------------------------------------------------------


def onednn_gemm_rate(n: int = 2048, repeats: int = 7) -> float | None:
    """The same product through oneDNN's linear kernel, which inductor uses for frozen weights
    (a private op, used here only to measure; None where this build lacks it)."""
    a, w = torch.randn(n, n), torch.randn(n, n)
    try:
        linear = torch.ops.mkldnn._linear_pointwise
        seconds = alternate({"onednn": lambda: linear(a, w, None, "none", [], "")}, repeats)["onednn"]
    except (AttributeError, RuntimeError):
        return None
    return 2 * n**3 / seconds


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_rss_above_baseline(fn: Callable[[], object]) -> float:
    """MiB of peak RSS during fn() above the RSS just before it (Linux: VmHWM reset via clear_refs)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the peak-RSS high-water mark to the current RSS
    baseline = _rss_kb("VmRSS")
    fn()
    return (_rss_kb("VmHWM") - baseline) / 1024


# --- workloads ----------------------------------------------------------------------------------


def forward(cfg: ModelConfig, batch: int, seq: int, repeats: int, rate: float, compiled: bool = False) -> dict:
    ours, hf = build_pair(cfg)
    ours.eval(), hf.eval()
    run = compile_for_inference(ours) if compiled else ours
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with torch.no_grad():
        t = alternate_times({"tlm": lambda: run(ids), "hf": lambda: hf(ids).logits}, repeats)
    flops = account(cfg, batch, seq).forward_flops_causal
    return _row(t, batch * seq, flops, rate)


def forward_backward(cfg: ModelConfig, batch: int, seq: int, repeats: int, rate: float, compiled: bool = False) -> dict:
    ours, hf = build_pair(cfg)
    ids, targets = torch.randint(0, cfg.vocab_size, (2, batch, seq))
    loss = torch.compile(ours.loss, mode="max-autotune-no-cudagraphs") if compiled else ours.loss

    def tlm_step():
        ours.zero_grad(set_to_none=True)
        loss(ids, targets).backward()

    def hf_step():
        hf.zero_grad(set_to_none=True)
        # HF shifts labels internally; give it the sequence whose shift is our (ids, targets).
        logits = hf(ids).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()

    t = alternate_times({"tlm": tlm_step, "hf": hf_step}, repeats)
    return _row(t, batch * seq, 3 * account(cfg, batch, seq).forward_flops_causal, rate)


def decode(cfg: ModelConfig, prompt_len: int, new_tokens: int, repeats: int, compiled: bool = False) -> dict:
    ours, hf = build_pair(cfg)
    ours.eval(), hf.eval()
    if compiled:
        ours = compile_for_inference(ours)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len))
    hf.generation_config.pad_token_id = 0

    def hf_generate():
        return hf.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    ours_out, hf_out = generate(ours, prompt, new_tokens, temperature=0), hf_generate()
    t = alternate_times({"tlm": lambda: generate(ours, prompt, new_tokens, temperature=0), "hf": hf_generate}, repeats)
    # Greedy decoding of the same weights should agree token for token (a near-tie may flip one).
    return _row(t, new_tokens, None, None) | {"same_tokens": bool(torch.equal(ours_out, hf_out))}


def _row(times: dict[str, list[float]], tokens: int, flops: float | None, rate: float | None) -> dict:
    t = {name: statistics.median(ts) for name, ts in times.items()}
    ratio, low, high = ratio_spread(times["hf"], times["tlm"])
    row = {
        "tlm_tok_s": tokens / t["tlm"],
        "hf_tok_s": tokens / t["hf"],
        "ratio": ratio,
        "ratio_range": [low, high],
        "load": load_average(),
    }
    if flops is not None:
        row["tlm_gemm_frac"] = flops / t["tlm"] / rate
        row["hf_gemm_frac"] = flops / t["hf"] / rate
    return row


def profile_training(cfg: ModelConfig, seq: int, top: int = 8) -> dict:
    """Where one eager training step of tlm spends its CPU time (torch.profiler, self time)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = TransformerLM(cfg)
    ids, targets = torch.randint(0, cfg.vocab_size, (2, 1, seq))
    model.loss(ids, targets).backward()  # warm-up
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.loss(ids, targets).backward()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return {e.key: e.self_cpu_time_total / total for e in events[:top]}


# --- memory, one subprocess per measurement -----------------------------------------------------


def child(kind: str, impl: str, seq: int) -> dict:
    """Build only the one model measured (random weights: values do not change memory), so no
    freed memory of another model sits in the process when the baseline is taken."""
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        **hf_llama_config_kwargs(SMALL if kind == "train" else XL_BLOCK), attn_implementation="sdpa"
    )
    if kind == "train":
        ids, targets = torch.randint(0, SMALL.vocab_size, (2, 1, seq))
        if impl == "tlm":
            model = TransformerLM(SMALL)

            def work():
                model.loss(ids, targets).backward()

        else:
            model = transformers.LlamaForCausalLM(hf_config)

            def work():
                logits = model(ids).logits
                torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()

    else:
        x = torch.randn(1, seq, XL_BLOCK.d_model)
        if impl == "tlm":
            cfg = XL_BLOCK
            model = TransformerBlock(cfg, fused=True)

            def work():
                with torch.no_grad():
                    model(x)

        else:
            model = transformers.LlamaModel(hf_config)
            model.norm = torch.nn.Identity()

            def work():
                with torch.no_grad():
                    model(inputs_embeds=x)

    gc.collect()
    start = time.perf_counter()
    peak = peak_rss_above_baseline(work)
    return {"peak_mib": peak, "seconds": time.perf_counter() - start}


def measure_in_subprocess(kind: str, impl: str, seq: int) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, impl, str(seq)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {result.returncode}: {' | '.join(tail)}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- report -------------------------------------------------------------------------------------


def render(results: dict, meta: dict) -> str:
    def speed(name: str, label: str, mode: str) -> str:
        r = results[name]
        gemm = f"{100 * r['tlm_gemm_frac']:.0f}% / {100 * r['hf_gemm_frac']:.0f}%" if "tlm_gemm_frac" in r else "–"
        spread = f" ({r['ratio_range'][0]:.2f}–{r['ratio_range'][1]:.2f})" if "ratio_range" in r else ""
        load = f" | {r['load']:.1f}" if "load" in r else " | –"
        return (
            f"| {label} | {mode} | {r['tlm_tok_s']:,.0f} tok/s | {r['hf_tok_s']:,.0f} tok/s | "
            f"**{r['ratio']:.2f}×**{spread} | {gemm}{load} |"
        )

    def memory(name: str, label: str, mode: str) -> str:
        r = results[name]
        if "error" in r["tlm"] or "error" in r["hf"]:
            cells = [
                r[impl].get("error", f"{r[impl]['peak_mib']:,.0f} MiB ({r[impl]['seconds']:.1f} s)")
                for impl in ("tlm", "hf")
            ]
            return f"| {label} | {mode} | {cells[0]} | {cells[1]} | – | | |"
        ratio = r["tlm"]["peak_mib"] / r["hf"]["peak_mib"]
        return (
            f"| {label} | {mode} | {r['tlm']['peak_mib']:,.0f} MiB ({r['tlm']['seconds']:.1f} s) | "
            f"{r['hf']['peak_mib']:,.0f} MiB ({r['hf']['seconds']:.1f} s) | **{ratio:.2f}×** | | |"
        )

    tlm_mode = "eager; attention `auto` (torch SDPA), fused q/k/v and w1/w3"
    inference = "`compile_for_inference` (inductor max-autotune, frozen weights)"
    lines = [
        "# Benchmarks: tlm vs HF transformers' Llama",
        "",
        "<!-- Generated by bench/run.py (`nox -s bench`); do not edit by hand. -->",
        "",
        f"Measured {meta['date']} on {meta['machine']}; torch {meta['torch']}, transformers "
        f"{meta['transformers']}, {meta['threads']} threads, float32. This machine's float32 GEMM rate "
        f"(2048³ `torch.mm`, the MKL kernel eager PyTorch uses, same run): **{meta['gemm_gflops']:.0f} GFLOP/s**"
        + (
            f"; the same product through oneDNN's linear kernel, which inductor uses for frozen weights: "
            f"**{meta['onednn_gflops']:.0f} GFLOP/s**. " + _onednn_note(meta["onednn_gflops"] / meta["gemm_gflops"])
            if meta["onednn_gflops"]
            else "."
        ),
        "",
        "Both sides hold the same weights (checked: logits agree to 1e-4 before timing). HF runs "
        '`LlamaForCausalLM` with `attn_implementation="sdpa"`, eager, in every row. Greedy decoding also checks '
        "that both produce the same tokens. Compiled rows exclude the one-off compile (done in the warm-up). "
        "Speed is the median of "
        f"{meta['repeats']} alternating repeats; ratio = tlm ÷ HF throughput (higher is better for tlm), the "
        "median of the per-repeat ratios and, in brackets, the lowest and highest; load = the 1-minute load "
        "average after the row (a shared machine: times move with it, same-repeat ratios much less). "
        "GEMM % = model matmul FLOPs per second (causal attention counted as half) over the GEMM rate. "
        "Memory = peak RSS above the RSS just before the call, in a fresh process each (ratio = tlm ÷ HF, "
        "lower is better for tlm).",
        "",
        "| workload | tlm mode | tlm | HF | ratio | GEMM % (tlm / HF) | load |",
        "|---|---|---:|---:|---:|---:|---:|",
        speed("fwd_course", "forward, course-tinystories, 4 × 256", tlm_mode),
        speed("fwd_small", "forward, GPT-2-small-like, 1 × 1024", tlm_mode),
        speed("train_course", "forward + backward (loss), course-tinystories, 4 × 256", tlm_mode + "; chunked loss"),
        speed("train_small", "forward + backward (loss), GPT-2-small-like, 1 × 1024", tlm_mode + "; chunked loss"),
        speed("decode", "greedy decode, batch 1, course config, 16 + 240 tokens", "eager, KV cache (both)"),
        speed("fwd_course_compiled", "forward, course-tinystories, 4 × 256", inference),
        speed("fwd_small_compiled", "forward, GPT-2-small-like, 1 × 1024", inference),
        speed(
            "train_course_compiled",
            "forward + backward (loss), course-tinystories, 4 × 256",
            '`torch.compile(model.loss, mode="max-autotune-no-cudagraphs")`',
        ),
        speed("decode_compiled", "greedy decode, batch 1, course config, 16 + 240 tokens", inference + ", KV cache"),
        memory("mem_train", "training peak memory, GPT-2-small-like, 1 × 1024", "`TransformerLM.loss` + backward"),
        memory("mem_block_4096", "one GPT-2-XL-width block, 1 × 4096, no grad", "eager, attention `auto`"),
        memory("mem_block_16384", "one GPT-2-XL-width block, 1 × 16384, no grad", "eager, attention `auto`"),
        "",
        "Where an eager training step of tlm (GPT-2-small-like, 1 × 1024) spends its CPU time, by "
        "torch.profiler self time: "
        + ", ".join(f"`{op}` {100 * share:.1f}%" for op, share in results["profile_train_small"].items())
        + ". The matrix multiplies are the same ones HF runs, through the same MKL kernel, which is why "
        "eager training stays near 1.0× HF.",
        "",
        "GPT-2-small-like: vocab 50257, d_model 768, 12 layers, 12 heads, d_ff 2048. "
        "GPT-2-XL-width block: d_model 1600, 25 heads, d_ff 6400. "
        "HF's training loss is the same cross-entropy over the same (ids, targets), computed from its full "
        "float32 logits; tlm's `loss` runs the LM head and cross-entropy in chunks of 256 tokens.",
        "",
    ]
    return "\n".join(lines)


def _onednn_note(advantage: float) -> str:
    """What the oneDNN / MKL rate ratio of this machine means for the compiled rows below."""
    if advantage >= 1.2:
        return (
            f"oneDNN runs {advantage:.1f}× MKL's rate here, which is most of why compiled inference rows exceed "
            "100% of the `torch.mm` rate and HF's eager speed."
        )
    return (
        f"oneDNN runs {advantage:.2f}× MKL's rate here, so the compiled forward rows gain only what inductor's "
        "fusion saves; on a machine where oneDNN ran 2.1-2.8× MKL (2026-11-30), compiled "
        'forward measured 1.97-2.11× HF and compiled decoding 3.28× (README, "Performance and reliability").'
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, print only")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "IMPL", "SEQ"), help=argparse.SUPPRESS)
    parser.add_argument("--from-json", type=pathlib.Path, help="re-render the table from a saved benchmarks.json")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        write_section("model", render(saved["results"], saved["meta"]), args.out)
        print(f"wrote {args.out}")
        return
    if args.child:
        kind, impl, seq = args.child
        print(json.dumps(child(kind, impl, int(seq))))
        return

    repeats = 3 if args.quick else 5
    rate, onednn = gemm_rate(), onednn_gemm_rate()
    print(f"GEMM rate: {rate / 1e9:.0f} GFLOP/s (torch.mm); oneDNN linear: {(onednn or 0) / 1e9:.0f}", flush=True)
    results: dict = {}
    jobs: dict[str, Callable[[], dict]] = {
        "fwd_course": lambda: forward(COURSE, 4, 256, repeats, rate),
        "fwd_small": lambda: forward(SMALL, 1, 1024, repeats, rate),
        "train_course": lambda: forward_backward(COURSE, 4, 256, repeats, rate),
        "train_small": lambda: forward_backward(SMALL, 1, 1024, max(3, repeats - 2), rate),
        "decode": lambda: decode(COURSE, 16, 240, max(3, repeats - 2)),
        "fwd_course_compiled": lambda: forward(COURSE, 4, 256, repeats, rate, compiled=True),
        "fwd_small_compiled": lambda: forward(SMALL, 1, 1024, repeats, rate, compiled=True),
        "train_course_compiled": lambda: forward_backward(COURSE, 4, 256, repeats, rate, compiled=True),
        "decode_compiled": lambda: decode(COURSE, 16, 240, max(3, repeats - 2), compiled=True),
        "profile_train_small": lambda: profile_training(SMALL, 1024),
        "mem_train": lambda: {impl: measure_in_subprocess("train", impl, 1024) for impl in ("tlm", "hf")},
        "mem_block_4096": lambda: {impl: measure_in_subprocess("block", impl, 4096) for impl in ("tlm", "hf")},
        "mem_block_16384": lambda: {impl: measure_in_subprocess("block", impl, 16_384) for impl in ("tlm", "hf")},
    }
    for name, job in jobs.items():
        start = time.perf_counter()
        results[name] = job()
        print(f"{name}: {json.dumps(results[name])} ({time.perf_counter() - start:.0f} s)", flush=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} Linux, {cpu_description()}",
        "load_end": load_average(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "gemm_gflops": rate / 1e9,
        "onednn_gflops": None if onednn is None else onednn / 1e9,
        "repeats": repeats,
    }
    text = render(results, meta)
    print(text)
    if not args.quick:
        write_section("model", text, args.out)
        (args.out.with_suffix(".json")).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
