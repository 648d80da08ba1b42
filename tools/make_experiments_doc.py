"""Generate docs/experiments.md: CS336 assignment 1's experiments (§7) at CPU scale, with `tlm sweep`.

    python tools/make_experiments_doc.py [--out-dir build/experiments] [--scale 1.0]   # nox -s experiments

Every number and figure in the document comes from the runs this script makes: a tokenizer trained on
Python's own pydoc topics (the corpus tlm train uses by default, shipped with CPython), then three
sweeps of a small model, each one `tlm sweep` run in this process: a learning-rate sweep reaching
divergence, a batch-size sweep at a matched token budget, and the four ablations beside the baseline at
matched parameters and tokens; then a 256-token sample from the best run. ``--scale`` multiplies the
steps (the page names the steps that made it); ``--reuse`` writes the page again from the finished runs.
"""

import argparse
import contextlib
import io
import json
import math
import os
import pathlib
import platform
import shutil
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "experiments.md"
FIGURES = ROOT / "docs" / "experiments"

VOCAB = 512
#: The model of every run: 4 heads of 32, two blocks; SwiGLU at the course's 8/3·d_model rounded to 64.
MODEL = {"context_length": 64, "d_model": 128, "num_layers": 2, "num_heads": 4, "d_ff": 384}
BASE = {"batch_size": 16, "eval_batches": 4, "sample_tokens": 0, "warmup_steps": 10, "seed": 0}
STEPS = 60  # about 18 minutes for the page at load 24 on 2 cores; --scale 3 for 180 steps
LRS = "1e-3,3e-3,1e-2,3e-2,1e-1,3e-1,1,3"
BATCHES = "4,16,64"
#: The ablations (runs file): SiLU's course width 4·d_model gives 2·128·512 FFN weights, SwiGLU's 3·128·384.
ABLATIONS = """
[runs.baseline]
[runs.post-norm]
model = { norm_placement = "post" }
[runs.no-norm]
model = { norm_placement = "none" }
[runs.nope]
model = { positions = "none" }
[runs.silu]
model = { ffn = "silu", d_ff = 512 }
"""


def cpu() -> str:
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    return f"{name}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"


def prepare(out: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, int]:
    """The tokenizer (trained on the corpus) and the corpus as one token file."""
    import numpy as np

    from tlm_tokenizer import Tokenizer, train_bpe
    from tlm_train import default_corpus

    tokens = out / "tokens.npy"
    if REUSE[0] and tokens.is_file() and (out / "tokenizer").is_dir():
        return out / "tokenizer", tokens, int(np.load(tokens, mmap_mode="r").shape[0])
    text = default_corpus()
    corpus = out / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(str(corpus), VOCAB, ["<|endoftext|>"], progress=False)
    tokenizer = Tokenizer(vocab, merges, special_tokens=["<|endoftext|>"])
    tokenizer.save(out / "tokenizer")
    np.save(tokens, np.asarray(tokenizer.encode(text), dtype=np.uint16))
    return out / "tokenizer", tokens, int(np.load(tokens, mmap_mode="r").shape[0])


def tlm(*argv: str) -> str:
    """Run a tlm command in this process; its standard output."""
    from tlm_command.main import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(list(argv))
    if code != 0:
        raise SystemExit(f"tlm {' '.join(argv)} exited {code}")
    return buffer.getvalue()


JOBS: list[str] = []
REUSE: list[bool] = [False]


def sweep(out: pathlib.Path, name: str, settings: dict[str, object], *plan: str) -> list[dict]:
    folder = out / name
    if not (REUSE[0] and (folder / "summary.json").is_file()):
        shutil.rmtree(folder, ignore_errors=True)
        sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
        tlm("sweep", "--out-dir", str(folder), *plan, *sets, *JOBS, "--quiet")
    FIGURES.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(folder / "sweep.png", FIGURES / f"{name}.png")
    return json.loads((folder / "summary.json").read_text())["runs"]


def table(runs: list[dict]) -> str:
    from tlm_command.compare import RunSummary, markdown

    return markdown([RunSummary(**{**r, "curve": []}) for r in runs])


def finished(runs: list[dict]) -> list[dict]:
    return [r for r in runs if r["final_val_loss"] is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=str(ROOT / "build" / "experiments"))
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the steps of every run")
    parser.add_argument("--jobs", type=int, default=None, help="tlm sweep --jobs (default: the sweep's)")
    parser.add_argument(
        "--reuse", action="store_true", help="write the page from the finished sweeps in --out-dir (no training)"
    )
    args = parser.parse_args()
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.jobs:
        JOBS[:] = ["--jobs", str(args.jobs)]
    REUSE[:] = [args.reuse]
    made = out / "made.json"  # how long the runs took to make, and the load then: kept for --reuse
    if args.reuse:
        if not made.is_file():
            raise SystemExit(f"--reuse: {made} is missing; run without --reuse first")
        jobs, minutes, load_before = (json.loads(made.read_text())[k] for k in ("jobs", "minutes", "load"))
    began = time.perf_counter()
    if not args.reuse:
        load_before = os.getloadavg()[0]
    tokenizer, tokens, n_tokens = prepare(out)
    steps = max(10, round(STEPS * args.scale))
    common = {"data": tokens, "tokenizer": tokenizer, "vocab_size": VOCAB, **BASE, **MODEL}
    common["steps"] = steps
    common["eval_interval"] = max(1, steps // 10)
    common["checkpoint_interval"] = steps

    # 1. Learning rate, without clipping or decay (so that nothing but the rate holds the run back).
    lr_settings = {**common, "grad_clip": 0, "weight_decay": 0}
    lr_runs = sweep(out, "lr", lr_settings, "--grid", f"lr={LRS}")
    good = finished(lr_runs)
    best = min(good, key=lambda r: r["final_val_loss"])
    best_lr = best["settings"]["lr"]
    diverged = [r for r in lr_runs if r["diverged"]]

    # 2. Batch size at one token budget, the rate scaled with the square root of the batch from the best one:
    # one named run per batch size (a runs file), each with its own rate and intervals.
    budget = steps * BASE["batch_size"] * MODEL["context_length"]
    lines = []
    for batch in map(int, BATCHES.split(",")):
        batch_steps = budget // (batch * MODEL["context_length"])
        lr = best_lr * math.sqrt(batch / BASE["batch_size"])
        lines += [f'[runs."batch={batch}"]', f"batch_size = {batch}", f"lr = {lr:.3g}", f"steps = {batch_steps}",
                  f"eval_interval = {max(1, batch_steps // 10)}", f"checkpoint_interval = {batch_steps}"]  # fmt: skip
    batch_file = out / "batch.toml"
    batch_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    batch_runs = sweep(out, "batch", common, "--runs", str(batch_file))

    # 3. The ablations at the best rate, with clipping and decay as tlm train's defaults.
    runs_file = out / "ablations.toml"
    runs_file.write_text(ABLATIONS, encoding="utf-8")
    ablation_runs = sweep(out, "ablations", {**common, "lr": best_lr}, "--runs", str(runs_file))

    # 4. A sample from the best learning-rate run.
    sample_run = out / "lr" / best["name"]
    sample = json.loads(tlm("generate", "--checkpoint", str(sample_run), "--prompt", "The ", "--max-new-tokens",
                            "256", "--temperature", "0.8", "--top-k", "50", "--json", "--quiet"))  # fmt: skip
    if not args.reuse:
        minutes = (time.perf_counter() - began) / 60
        made.write_text(json.dumps({"jobs": jobs, "minutes": minutes, "load": load_before}) + "\n")
    write(locals())


def write(v: dict) -> None:
    lr_runs, batch_runs, ablation_runs = v["lr_runs"], v["batch_runs"], v["ablation_runs"]
    by = {r["name"]: r for r in ablation_runs}
    base = by["baseline"]

    def delta(name: str) -> str:
        r = by[name]
        if r["final_val_loss"] is None:
            return f"{name} did not finish (diverged at step {r['diverged_at']})"
        d = r["final_val_loss"] - base["final_val_loss"]
        return f"{name} {'+' if d >= 0 else '−'}{abs(d):.3f}"

    diverged = v["diverged"]
    if diverged:
        first = min(diverged, key=lambda r: r["settings"]["lr"])
        others = ", ".join(f"{r['settings']['lr']:g}" for r in diverged if r is not first)
        where = (
            f"The run at lr = {first['settings']['lr']:g} diverged: its loss stopped being finite at step "
            f"{first['diverged_at']}, and the sweep recorded it as diverged and went on"
            + (f"; so did {others}" if others else "")
            + "."
        )
    else:
        where = "No rate in this grid diverged at this scale (the loss stayed finite throughout)."
    ok = sorted(finished(lr_runs), key=lambda r: r["settings"]["lr"])
    largest_ok = ok[-1]["settings"]["lr"] if ok else None
    epochs = base["tokens"] / (v["n_tokens"] * 0.9)  # the training split: all but the last 10%
    seen = (
        f"a corpus this small is seen {epochs:.1f} times over, so the validation loss measures memorisation as "
        "much as generalisation"
        if epochs > 1
        else f"each run saw {epochs:.0%} of the training tokens, once: short runs, far from converged, so an "
        "effect that shows late in training cannot show here"
    )
    sample = v["sample"]
    text = sample.get("text") or sample.get("completion") or json.dumps(sample)
    batch_text = (
        "; ".join(
            f"batch {r['settings']['batch_size']}: {r['final_val_loss']:.3f} in {r['wall_time_s']:.0f} s"
            if r["final_val_loss"] is not None
            else f"batch {r['settings']['batch_size']}: diverged at step {r['diverged_at']}"
            for r in batch_runs
        )
        + "."
    )
    doc = f"""# Experiments at CPU scale

<!-- Generated by `nox -s experiments` (tools/make_experiments_doc.py) from the runs it makes. Do not edit by hand. -->

CS336 assignment 1 asks for an experiment log, a learning-rate sweep that reaches divergence, a batch-size
sweep, four ablations and a sample. This page is those experiments at the scale of a laptop CPU, each one
`tlm sweep` (every run an ordinary run folder; the tables are the sweeps' `summary.md`, the figures their
`sweep.png`). Machine: **{cpu()}**, load average {v["load_before"]:.1f} when it began (the machine is
shared; wall times and tokens/s move with the load, losses do not). The whole page took {v["minutes"]:.1f}
minutes to make, {f"{v['jobs']} runs at a time" if v["jobs"] else "with tlm sweep's default --jobs"} (each run on
one thread when several share the CPU).

**Setup.** Corpus: Python's own pydoc topics (`pydoc_data.topics`, shipped with CPython), {v["n_tokens"]:,}
tokens under a {VOCAB}-token byte-level BPE trained on it; the last 10% held out. Model: {MODEL["num_layers"]}
blocks, d_model {MODEL["d_model"]}, {MODEL["num_heads"]} heads, context {MODEL["context_length"]}, SwiGLU
d_ff {MODEL["d_ff"]} ({base["parameters"]:,} parameters); AdamW, warm-up then cosine; {v["steps"]} steps of
{BASE["batch_size"]} × {MODEL["context_length"]} tokens unless said otherwise. Validation loss is the mean
cross-entropy (nats/token) over {BASE["eval_batches"]} fixed held-out batches.

## Learning rate

{table(lr_runs)}
![validation loss by step and by wall-clock time, and final loss by learning rate](experiments/lr.png)

Without gradient clipping or weight decay. {where} The best final loss came at lr = {v["best_lr"]:g}
({v["best"]["final_val_loss"]:.3f}){f"; the largest rate that still finished was {largest_ok:g}" if largest_ok else ""}.
The left panel is the loss by step, the middle one the same curves by wall-clock time (the experiment log),
the right one the final loss by rate on a log axis, a red × where a run diverged.

## Batch size

{table(batch_runs)}
![validation loss of each batch size by step and by wall-clock time, and the final losses](experiments/batch.png)

Each batch size trained on the same {v["budget"]:,} tokens, its learning rate scaled by
√(batch / {BASE["batch_size"]})
from the best one above: {batch_text} A small batch takes more, noisier steps for the same tokens. The wall
times include the evaluations (one per tenth of a run: every step of the largest batch's) and were measured
with runs sharing a loaded CPU, so they say little about what a batch size costs here.

## Ablations

{table(ablation_runs)}
![validation loss of the baseline and the four ablations](experiments/ablations.png)

At the best rate of the sweep, with clipping and weight decay. Final loss against the baseline's
({base["final_val_loss"]:.3f}): {"; ".join(delta(n) for n in ("post-norm", "no-norm", "nope", "silu"))}.
The SiLU FFN (two matrices at d_ff = 4·d_model) is matched to SwiGLU (three at d_ff ≈ 8/3·d_model) in
parameters: {by["silu"]["parameters"]:,} against {base["parameters"]:,}, on the same tokens.

## Sample

256 tokens from the best learning-rate run (`tlm generate --checkpoint RUN --prompt "The " --max-new-tokens 256
--temperature 0.8 --top-k 50`):

```text
{text.strip()}
```

## What these figures show, and what they cannot

They show the shape of each effect on one small model and one small corpus: how loss falls with steps and
with time, where a learning rate too large makes the loss blow up, how the batch size trades steps for
tokens, and how each ablation moves the loss of the same model on the same tokens. They cannot show how
these effects scale: {v["steps"]} steps of a {base["parameters"] / 1e6:.1f} M-parameter model on a
{v["n_tokens"] / 1e6:.2f} M-token corpus is far from the course's TinyStories or OpenWebText runs, the
differences between ablations are of the size that another seed could move (one seed each here), the best
rate of a short run is not the best rate of a long one, and {seen}. The sample shows what the model
learned of the corpus's words and layout, not fluent English.
"""
    DOC.write_text(doc, encoding="utf-8")
    print(f"wrote {DOC} and {FIGURES}/ in {v['minutes']:.1f} min")


if __name__ == "__main__":
    sys.exit(main())
