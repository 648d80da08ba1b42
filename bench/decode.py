"""Fast decoding: tlm's static-cache decode step (``DecodeBatch``, ``compile_for_inference``) against HF
transformers' ``generate`` on the HF export of the same weights, and the step's time against the cache's capacity.

Run through ``nox -s bench -- decode`` to write its section of docs/benchmarks.md; ``python bench/decode.py
--quick`` is a short run that prints the table (``--only batch|single|capacity`` runs one part; ``--cpu-time``
times by this process's CPU seconds instead of wall time, which a busy shared machine distorts far less).

Method. The course model's shape (``course-tinystories``) with random weights; HF's ``LlamaForCausalLM`` holds
the same weights (``tlm_model.interop``'s export). One thread on each side (``torch.set_num_threads(1)``, the
default here; ``--threads`` to change it). Every timing alternates tlm and HF round by round after a warm-up
(compilation happens in the warm-up, outside the timings), and a ratio is HF's time over tlm's in the same
round: the median and the range over the rounds are reported.

- **batch**: 16 greedy completions of ``--new`` tokens for prompts of 16 different lengths. tlm: one
  ``DecodeBatch`` (``add_many``: the prompts prefilled together, then one batched step a token, argmax). HF:
  ``generate`` on the 16 prompts left-padded into one batch with an attention mask. The greedy tokens are checked
  equal row for row (tlm eager and compiled).
- **single**: one prompt, ``--new`` greedy tokens. tlm: ``generate`` on ``compile_for_inference(model)``
  (static caches, one compiled step). HF: eager ``generate`` (its dynamic cache), and ``generate`` with
  ``cache_implementation="static"`` and ``forward`` compiled with ``torch.compile`` (transformers' documented
  fast path; given the same inductor mode and weight freezing as tlm).
- **ttft**: ``tlm serve``'s scheduler in this process (no HTTP, the eager model: ``--no-compile``; with
  ``--compiled-ttft`` the compiled one, warmed up first), the course shape with a 2560-token context: the time
  from submitting a 16-token greedy request to its first token, on an idle scheduler and while a 2000-token prompt
  is being prefilled (submitted 30 to 90 ms before, seeded uniform: the short one lands anywhere in a chunk), at
  prefill forwards of 64 tokens, one an iteration (the scheduler's policy before this round), of 32 (its default
  since) and of 16 under its budget an iteration.
- **single_all**: **single** again with every core on each side (``os.cpu_count()`` threads), timed by wall
  time, in a process of its own (inductor's kernels keep the thread count they were compiled under). One thread
  of this CPU reads the 70 MB of float32 weights a token needs in about 2.3 ms (``Tensor.sum``), which caps
  the one-thread ratio against HF's eager ``generate`` near 3x however little else a step does; more cores
  read faster.
- **capacity**: one compiled step of a batch of 1 at cache capacities 128, 512 and 2048 (the course shape with a
  2048-token context), a short sequence (9 to 25 tokens): the step writes one token in place and reads only the
  occupied prefix of the cache (its slot bucket, 64 slots here), so its time should not depend on the capacity.
  The ratios 2048/128 and 512/128 are reported (per round, median and range).
"""

import argparse
import contextlib
import json
import pathlib
import random
import statistics
import sys
import time

import torch
import torch._inductor.config as inductor_config
import transformers
from _common import alternate_times, cpu_description, load_average, ratio_spread, write_section

from tlm_model import ModelConfig, TransformerLM, compile_for_inference, generate
from tlm_model.batching import DecodeBatch
from tlm_model.interop import hf_llama_config_kwargs, to_hf_llama_state_dict

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: What the timings read: wall time, or with ``--cpu-time`` this process's CPU time (one thread per side, so CPU
#: time is the work done; a machine shared with other jobs inflates it far less than wall time).
CLOCK = time.perf_counter
COURSE = ModelConfig.from_preset("course-tinystories")
PROMPT_LENGTHS = [3, 9, 17, 30, 5, 12, 44, 21, 7, 60, 14, 26, 2, 38, 11, 50]


def build_pair(cfg: ModelConfig) -> tuple[TransformerLM, torch.nn.Module]:
    torch.manual_seed(0)
    ours = TransformerLM(cfg).eval()
    hf_config = transformers.LlamaConfig(**hf_llama_config_kwargs(cfg), attn_implementation="sdpa")
    hf = transformers.LlamaForCausalLM(hf_config)
    hf.load_state_dict(to_hf_llama_state_dict(ours.state_dict(), cfg))
    hf.eval()
    hf.generation_config.pad_token_id = 0
    return ours, hf


def _stats(times: dict[str, list[float]], tokens: int, reference: str, ours: str) -> dict:
    ratio, low, high = ratio_spread(times[reference], times[ours])
    return {
        "tlm_tok_s": tokens / statistics.median(times[ours]),
        "hf_tok_s": tokens / statistics.median(times[reference]),
        "ratio": ratio,
        "range": [low, high],
        "load": load_average(),
    }


def batch(new: int, repeats: int) -> dict:
    ours, hf = build_pair(COURSE)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, COURSE.vocab_size, (n,), generator=gen) for n in PROMPT_LENGTHS]
    width = max(PROMPT_LENGTHS)
    padded = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, width - len(p) :], mask[b, width - len(p) :] = p, 1
    capacity = width + new

    def hf_generate():
        out = hf.generate(padded, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return out[:, width:]

    def tlm_decode(model):
        def run():
            decoder = DecodeBatch(model, len(prompts), capacity=capacity)
            logits = decoder.add_many(prompts)
            tokens = []
            for step in range(new):
                token = logits.argmax(-1)
                tokens.append(token)
                if step + 1 < new:
                    logits = decoder.step(token)
            return torch.stack(tokens, 1)

        return run

    fast = compile_for_inference(ours)
    eager_run, fast_run = tlm_decode(ours), tlm_decode(fast)
    start = time.perf_counter()
    with torch.no_grad():
        fast_tokens = fast_run()  # compiles the step at 16 rows and the prompts' chunk
    compile_s = time.perf_counter() - start
    with torch.no_grad():
        expected, eager_tokens = hf_generate(), eager_run()
    same = {"eager": bool(torch.equal(eager_tokens, expected)), "compiled": bool(torch.equal(fast_tokens, expected))}
    with torch.no_grad():
        times = alternate_times({"hf": hf_generate, "eager": eager_run, "compiled": fast_run}, repeats, clock=CLOCK)
    tokens = len(prompts) * new
    return {
        "eager": _stats(times, tokens, "hf", "eager"),
        "compiled": _stats(times, tokens, "hf", "compiled"),
        "same_tokens": same,
        "compile_s": compile_s,
    }


def single(new: int, repeats: int) -> dict:
    ours, hf = build_pair(COURSE)
    prompt = torch.randint(1, COURSE.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    fast = compile_for_inference(ours)
    hf_static = transformers.LlamaForCausalLM(hf.config)
    hf_static.load_state_dict(hf.state_dict())
    hf_static.eval()
    hf_static.generation_config.pad_token_id = 0
    hf_static.forward = torch.compile(hf_static.forward, mode="max-autotune-no-cudagraphs", fullgraph=True)

    def hf_eager():
        return hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    def hf_compiled():
        with inductor_config.patch(freezing=True):
            return hf_static.generate(
                prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static"
            )

    def tlm():
        return generate(fast, prompt, new, temperature=0)

    start = time.perf_counter()
    with torch.no_grad():
        ours_out = tlm()
    compile_s = time.perf_counter() - start
    with torch.no_grad():
        same = {"eager": torch.equal(ours_out, hf_eager()), "compiled": torch.equal(ours_out, hf_compiled())}
        times = alternate_times({"tlm": tlm, "hf_eager": hf_eager, "hf_compiled": hf_compiled}, repeats, clock=CLOCK)
    return {
        "vs_eager": _stats(times, new, "hf_eager", "tlm"),
        "vs_compiled": _stats(times, new, "hf_compiled", "tlm"),
        "same_tokens": same,
        "compile_s": compile_s,
    }


def single_all_cores(new: int, quick: bool) -> dict:
    """:func:`single` with every core on each side, timed by wall time, in a process of its own: inductor's C++
    kernels take the thread count they were compiled under, so they are compiled there, at that count."""
    import os
    import subprocess
    import tempfile

    threads = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "single.json"
        command = [sys.executable, __file__, "--only", "single", "--threads", str(threads), "--new", str(new),
                   "--json", str(out), *(["--quick"] if quick else []), "--no-write"]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        run = json.loads(out.read_text())
    return run["results"]["single"] | {"threads": threads, "clock": "wall time"}


def capacity(steps: int, repeats: int) -> dict:
    import dataclasses

    cfg = dataclasses.replace(COURSE, context_length=2048)
    torch.manual_seed(0)
    fast = compile_for_inference(TransformerLM(cfg).eval())
    rows = {}
    for size in (128, 512, 2048):
        decoder = DecodeBatch(fast, 1, capacity=size)
        token = decoder.add(torch.arange(1, 9)).argmax(-1, keepdim=True)
        decoder.step(token)  # compiles this capacity's graph

        def run(decoder=decoder, token=token):
            decoder.cache.truncate([9])  # back to 9 tokens: every round steps from the same place
            for _ in range(steps):
                decoder.step(token)

        rows[size] = run
    times = alternate_times({str(size): fn for size, fn in rows.items()}, repeats, clock=CLOCK)
    flatness = {f"{size}/128": ratio_spread(times[size], times["128"]) for size in ("512", "2048")}
    return {size: 1e3 * statistics.median(ts) / steps for size, ts in times.items()} | {
        "ratios": flatness,
        "load": load_average(),
    }


def ttft(repeats: int, compiled: bool = False) -> dict:
    import dataclasses
    import threading

    from tlm_model.scheduler import PREFILL_BUDGET, PREFILL_CHUNK, Request, Scheduler

    class Bytes:  # the scheduler's text stream needs bytes per id; any will do for timing
        vocab_size = COURSE.vocab_size

        def decode_bytes(self, ids):
            return b"x" * len(ids)

    cfg = dataclasses.replace(COURSE, context_length=2560)
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    gen = torch.Generator().manual_seed(3)
    short = torch.randint(1, cfg.vocab_size, (16,), generator=gen).tolist()
    long = torch.randint(1, cfg.vocab_size, (2000,), generator=gen).tolist()

    def send(scheduler, prompt, max_tokens):
        done = threading.Event()
        request = Request(prompt, max_tokens, lambda piece, done=done: piece.finish_reason and done.set(),
                          temperature=0.0)  # fmt: skip
        request.submitted = time.perf_counter()
        scheduler.submit(request)
        return request, done

    rows = {}
    # (tokens a prefill forward, tokens an iteration): 64/64 is one chunk of 64 an iteration, the scheduler's
    # policy before this round; PREFILL_CHUNK/PREFILL_BUDGET its default since.
    served = compile_for_inference(model) if compiled else model
    for chunk, budget in ((64, 64), (PREFILL_CHUNK, PREFILL_BUDGET), (16, PREFILL_BUDGET)):
        start = time.perf_counter()
        scheduler = Scheduler(served, Bytes(), max_batch=4, max_queue=4, eos_ids=[], device=torch.device("cpu"),
                              warm_up=compiled)  # fmt: skip
        warm_s = time.perf_counter() - start
        scheduler.batch.prefill_chunk, scheduler.prefill_budget = chunk, budget
        if compiled:  # the chunks' graph takes a prompt as long as the long one's rows once before the timing
            send(scheduler, long, 2)[1].wait()

        idle, busy, arrival = [], [], random.Random(0)
        for _ in range(repeats):
            request, done = send(scheduler, short, 2)
            done.wait()
            idle.append(request.first_token_at - request.submitted)
            _, background_done = send(scheduler, long, 2)
            time.sleep(arrival.uniform(0.03, 0.09))  # its prefill under way
            request, done = send(scheduler, short, 2)
            done.wait()
            busy.append(request.first_token_at - request.submitted)
            background_done.wait()
        scheduler.close(timeout=5)
        rows[f"{chunk}/{budget}"] = {
            "warm_up_s": warm_s,
            "idle_ms": 1e3 * statistics.median(idle),
            "busy_ms": 1e3 * statistics.median(busy),
            "ratio": statistics.median(busy) / statistics.median(idle),
            "busy_range_ms": [1e3 * min(busy), 1e3 * max(busy)],
        }
    return rows | {"load": load_average()}


def render(results: dict, meta: dict) -> str:
    lines = [
        "# Fast decoding: tlm's static-cache step vs HF transformers' generate",
        "",
        f"Measured {meta['date']} on {meta['cpu']}, torch {meta['torch']}, transformers {meta['transformers']}, "
        f"{meta['threads']} thread(s) per side, timed by {meta.get('clock', 'wall time')}; this machine's CPU is "
        "shared with other work, so each ratio is the "
        "median of per-round ratios (tlm and HF alternate) with its range. `--new` tokens per completion: "
        f"{meta['new']}; timed rounds per figure: {meta.get('repeats', '?')}. Method: `bench/decode.py`'s docstring.",
        "",
        "| workload | tlm tok/s | reference | reference tok/s | ratio (range) | greedy tokens equal | load |",
        "|---|---:|---|---:|---|---|---:|",
    ]

    def row(name, r, ref, same):
        lo, hi = r["range"]
        lines.append(
            f"| {name} | {r['tlm_tok_s']:.0f} | {ref} | {r['hf_tok_s']:.0f} | {r['ratio']:.2f}x ({lo:.2f}-{hi:.2f}) "
            f"| {same} | {r['load']:.1f} |"
        )

    if "batch" in results:
        b = results["batch"]
        row("16 prompts, DecodeBatch eager", b["eager"], "HF batched generate", b["same_tokens"]["eager"])
        row("16 prompts, DecodeBatch compiled", b["compiled"], "HF batched generate", b["same_tokens"]["compiled"])
    if "single" in results:
        s = results["single"]
        row("batch 1, generate compiled", s["vs_eager"], "HF eager generate", s["same_tokens"]["eager"])
        reference = "HF static cache + torch.compile"
        row("batch 1, generate compiled", s["vs_compiled"], reference, s["same_tokens"]["compiled"])
    if "single_all" in results:
        s = results["single_all"]
        name = f"batch 1, generate compiled, {s['threads']} threads a side ({s['clock']})"
        row(name, s["vs_eager"], "HF eager generate", s["same_tokens"]["eager"])
        row(name, s["vs_compiled"], "HF static cache + torch.compile", s["same_tokens"]["compiled"])
    if "capacity" in results:
        c = results["capacity"]
        lines += [
            "",
            "Compiled decode step (batch 1, 9 to 25 tokens stored) against the cache's capacity, ms per step: "
            + ", ".join(f"{size}: {c[size]:.2f}" for size in ("128", "512", "2048"))
            + "; per-round ratios "
            + ", ".join(f"{k}: {v[0]:.2f} ({v[1]:.2f}-{v[2]:.2f})" for k, v in c.get("ratios", {}).items())
            + f" (load {c['load']:.1f}). The write of the new token is in place (a test reads inductor's code) and "
            "the attention reads only the occupied prefix (a slot bucket of 64 here), so nothing grows with the "
            "capacity.",
        ]
    if "ttft" in results:
        t = results["ttft"]
        mode = "compiled" if t.get("compiled") else "eager"
        lines += [
            "",
            f"Time to first token of a 16-token request (scheduler in-process, {mode}), "
            "idle vs while a 2000-token prompt prefills, by prefill tokens a forward / an iteration: "
            + "; ".join(
                f"{c}: {t[c]['idle_ms']:.0f} ms vs {t[c]['busy_ms']:.0f} ms ({t[c]['ratio']:.2f}x)"
                for c in t
                if "/" in c
            )
            + f" (load {t['load']:.1f}).",
        ]
    compile_s = {k: round(v["compile_s"]) for k, v in results.items() if isinstance(v, dict) and "compile_s" in v}
    if compile_s:
        lines += ["", f"Compilation before the timings (s, not timed): {compile_s}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, print only")
    parser.add_argument("--only", choices=["batch", "single", "single_all", "capacity", "ttft"], action="append")
    parser.add_argument("--new", type=int, default=32, help="new tokens per completion")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compiled-ttft", action="store_true", help="ttft on compile_for_inference (the server's)")
    parser.add_argument("--cpu-time", action="store_true", help="time by CPU seconds, not wall (busy machines)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--json", type=pathlib.Path, help="also write the results here")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument(
        "--from-json", type=pathlib.Path, nargs="+", metavar="FILE",
        help="write the section from the results of earlier runs (--json), each part from the last file holding it",
    )  # fmt: skip
    args = parser.parse_args()
    if args.from_json:
        saved = [json.loads(path.read_text()) for path in args.from_json]
        results = {k: v for run in saved for k, v in run["results"].items()}
        repeats = sorted({run["meta"].get("repeats", "?") for run in saved}, key=str)
        meta = saved[-1]["meta"] | {"repeats": repeats[0] if len(repeats) == 1 else repeats}
        write_section("decode", render(results, meta), args.out)
        return
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    repeats = 3 if args.quick else 7
    parts = args.only or ["batch", "single", "single_all", "capacity", "ttft"]
    results = {}
    for part in parts:
        start = time.perf_counter()
        if part == "batch":
            results[part] = batch(args.new, repeats)
        elif part == "single":
            results[part] = single(args.new, repeats)
        elif part == "single_all":
            results[part] = single_all_cores(args.new, args.quick)
        elif part == "ttft":
            results[part] = ttft(repeats, args.compiled_ttft)
            results[part]["compiled"] = args.compiled_ttft
        else:
            results[part] = capacity(16, repeats)
        print(f"{part}: {json.dumps(results[part])} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": args.threads,
        "new": args.new,
        "repeats": repeats,
        "clock": "CPU time" if args.cpu_time else "wall time",
    }
    text = render(results, meta)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "meta": meta}, indent=1))
    if not (args.quick or args.no_write):
        write_section("decode", text, args.out)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
