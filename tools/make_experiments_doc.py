"""Generate docs/experiments.md: CS336 assignment 1's experiments (§7) at CPU scale, with `tlm sweep` and seeds.

    python tools/make_experiments_doc.py [--out-dir build/experiments] [--jobs N]   # nox -s experiments
    python tools/make_experiments_doc.py --smoke --doc /tmp/smoke.md                   # the same, tiny, in a minute

Every number, sentence and figure of the page comes from the runs this script makes: a tokenizer trained on
Python's own pydoc topics (the corpus tlm train uses by default, shipped with CPython), then four sweeps of
one small model, each one `tlm sweep` run in this process with 3 seeds per setting: the learning rate to
divergence; RMSNorm removed at the best rate and below it; post-norm, NoPE and SiLU beside the baseline;
batch sizes from 1 up, the rate re-tuned for each; then a 256-token sample from the best run.

Resumable: each sweep's plan is kept beside it (SWEEP.plan.json). Run again after a stop (Ctrl-C, a kill) and
every sweep whose plan is unchanged continues where it stopped (`tlm sweep --resume`; finished runs are kept),
and a finished generation writes the page again in seconds. The page gives the wall time of the generation,
summed over the invocations that made its runs.
"""

import argparse
import contextlib
import copy
import io
import itertools
import json
import math
import os
import pathlib
import platform
import shutil
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]

VOCAB = 512
#: The model of every run: 4 blocks of 4 heads of 32; SwiGLU at the course's 8/3·d_model rounded to 64.
MODEL = {"context_length": 64, "d_model": 128, "num_layers": 4, "num_heads": 4, "d_ff": 384}
#: Without gradient clipping or weight decay, so that nothing but the rate and the architecture holds a run back.
BASE = {"batch_size": 16, "sample_tokens": 0, "seed": 0, "grad_clip": 0, "weight_decay": 0}
STEPS = 400
SEEDS = 3
EVALS = 20  # evaluations per run (every STEPS / EVALS steps), each over the same EVAL_WINDOWS held-out windows
EVAL_WINDOWS = 128
LRS = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0]
BATCHES = [1, 4, 16, 64, 256]
MIN_STEPS = 10  # a batch size whose share of the token budget is fewer steps is not run
#: The ablations: SiLU's course width 4·d_model gives 2·128·512 FFN weights per block, SwiGLU's 3·128·384.
ABLATIONS = {
    "post-norm": {"model": {"norm_placement": "post"}},
    "nope": {"model": {"positions": "none"}},
    "silu": {"model": {"ffn": "silu", "d_ff": "4·d_model"}},  # d_ff set from MODEL when the sweep is planned
}
#: A tiny version of everything, to check the whole command in about a minute (--smoke).
SMOKE = {
    "MODEL": {"context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64},
    "STEPS": 12, "SEEDS": 2, "EVALS": 3, "EVAL_WINDOWS": 8, "LRS": [1e-2, 1e3], "BATCHES": [4, 16],
}  # fmt: skip


def cpu() -> str:
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    return f"{name}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"


def prepare(out: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, int]:
    """The tokenizer (trained on the corpus) and the corpus as one token file (kept: made once)."""
    import numpy as np

    from tlm_tokenizer import Tokenizer, train_bpe
    from tlm_train import default_corpus

    tokens = out / "tokens.npy"
    if not (tokens.is_file() and (out / "tokenizer").is_dir()):
        text = default_corpus()
        corpus = out / "corpus.txt"
        corpus.write_text(text, encoding="utf-8")
        vocab, merges = train_bpe(str(corpus), VOCAB, ["<|endoftext|>"], progress=False)
        tokenizer = Tokenizer(vocab, merges, special_tokens=["<|endoftext|>"])
        shutil.rmtree(out / "tokenizer", ignore_errors=True)
        tokenizer.save(out / "tokenizer")
        np.save(out / "tokens.tmp.npy", np.asarray(tokenizer.encode(text), dtype=np.uint16))
        os.replace(out / "tokens.tmp.npy", tokens)
    return out / "tokenizer", tokens, int(np.load(tokens, mmap_mode="r").shape[0])


def tlm(*argv: str) -> str:
    """Run a tlm command in this process; its standard output."""
    from tlm_command.main import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(list(argv))
    if code != 0:
        raise SystemExit(f"tlm {' '.join(argv)} exited {code}" + (" (run this script again to continue)"
                                                                  if code == 130 else ""))  # fmt: skip
    return buffer.getvalue()


JOBS: list[str] = []


#: Seconds each sweep took, summed over the invocations that made its runs (its plan file keeps them).
SWEEP_SECONDS: dict[str, float] = {}


def sweep(out: pathlib.Path, name: str, settings: dict[str, Any], *plan: str,
          runs: dict[str, dict[str, Any]] | None = None, seeds: int | None = None) -> list[Any]:  # fmt: skip
    """One sweep (a grid in ``plan``, or named ``runs``), continued when a sweep of the same plan is there (else
    made anew): its runs' summaries."""
    from tlm_experiments import sweep as sweeps

    seeds = SEEDS if seeds is None else seeds
    folder = out / name
    key = out / f"{name}.plan.json"
    wanted = {"settings": {k: str(v) for k, v in settings.items()}, "plan": plan, "runs": runs, "seeds": seeds}
    kept = json.loads(key.read_text()) if key.is_file() else {}
    began = time.perf_counter()
    if (folder / "sweep.json").is_file() and kept.get("plan") == json.loads(json.dumps(wanted)):
        seconds = kept.get("seconds", 0.0)
        resume = ["sweep", "--resume", str(folder), *JOBS, "--quiet"]
    else:
        shutil.rmtree(folder, ignore_errors=True)
        seconds = 0.0
        sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
        what = ["--runs", str(runs_file(out / f"{name}.toml", runs))] if runs is not None else list(plan)
        resume = ["sweep", "--out-dir", str(folder), *what, *sets, "--seeds", str(seeds), *JOBS, "--quiet"]
    try:
        tlm(*resume)
    finally:
        now = time.perf_counter() - began
        SWEEP_SECONDS["(this invocation)"] = SWEEP_SECONDS.get("(this invocation)", 0.0) + now
        seconds += now
        SWEEP_SECONDS[name] = seconds
        key.write_text(json.dumps({"plan": wanted, "seconds": seconds}, indent=1) + "\n")
    return list(sweeps.summarize(folder, sweeps.read_manifest(folder)))


def runs_file(path: pathlib.Path, runs: dict[str, dict[str, Any]]) -> pathlib.Path:
    """A tlm sweep runs file: one [runs.NAME] table of settings per run."""
    lines = []
    for name, table in runs.items():
        lines.append(f'[runs."{name}"]')
        for key, value in table.items():
            if isinstance(value, dict):
                inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{key} = {{ {inner} }}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def renamed(summaries: list[Any], name: str, settings: dict[str, Any]) -> list[Any]:
    """Copies of runs under another setting's name (``NAME,seed=K``) and settings (a baseline beside others)."""
    out = []
    for s in summaries:
        s = copy.copy(s)
        s.name, s.settings = f"{name},seed={s.seed}", {**settings, "seed": s.seed}
        out.append(s)
    return out


def lr_of(s: Any) -> float:
    return float(s.settings["lr"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=str(ROOT / "build" / "experiments"))
    parser.add_argument("--jobs", type=int, default=None, help="tlm sweep --jobs (default: the sweep's)")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "experiments.md"), help="the page (figures beside it)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and few runs: checks the command")
    args = parser.parse_args()
    if args.smoke:
        globals().update(copy.deepcopy(SMOKE))
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.jobs:
        JOBS[:] = ["--jobs", str(args.jobs)]
    doc = pathlib.Path(args.doc)
    figures = doc.parent / doc.stem
    figures.mkdir(parents=True, exist_ok=True)

    # The time of the page: each sweep's (summed over the invocations that made its runs) and this invocation's
    # other work (the tokenizer, the figures, the sample).
    session = {"load": os.getloadavg()[0], "jobs": args.jobs}
    began = time.perf_counter()
    v = run_all(out, figures)
    other = time.perf_counter() - began - SWEEP_SECONDS.pop("(this invocation)")
    total = other + sum(SWEEP_SECONDS.values())
    made = {"session": session, "minutes": total / 60, "sweeps": {n: s / 60 for n, s in SWEEP_SECONDS.items()}}
    v["made"] = made
    v["figures"] = figures.name
    doc.write_text(page(v), encoding="utf-8")
    print(f"wrote {doc} and {figures}/: {made['minutes']:.1f} min of runs and writing")


def run_all(out: pathlib.Path, figures: pathlib.Path) -> dict[str, Any]:
    from tlm_experiments.compare import plot
    from tlm_experiments.results import group_runs

    tokenizer, tokens, n_tokens = prepare(out)
    interval = max(1, STEPS // EVALS)
    common = {"data": tokens, "tokenizer": tokenizer, "vocab_size": VOCAB, **BASE, **MODEL, "steps": STEPS,
              "eval_interval": interval, "checkpoint_interval": STEPS, "warmup_steps": max(1, STEPS // 10),
              "eval_batches": max(1, EVAL_WINDOWS // BASE["batch_size"])}  # fmt: skip

    # 1. The learning rate, to divergence.
    lr_runs = sweep(out, "lr", common, "--grid", "lr=" + ",".join(f"{r:g}" for r in LRS))
    lr_groups = group_runs(lr_runs)
    stable = [g for g in lr_groups if g.finals() and not any(r.status == "diverged" for r in g.runs)]
    best_group = min(stable or lr_groups, key=lambda g: sum(g.finals().values()) / max(1, len(g.finals())))
    best_lr = float(best_group.settings["lr"])
    plot(lr_runs, figures / "lr.png", title="learning-rate sweep")

    # 2. RMSNorm removed, at the best rate, the two grid rates below it (does a lower rate restore stability?) and
    # the two above (where does the edge move?); the baseline's runs at those rates are the learning-rate sweep's
    # (the same settings and seeds, so the pairs are by seed).
    norm_lrs = [*[r for r in LRS if r < best_lr][-2:], best_lr, *[r for r in LRS if r > best_lr][:2]]
    norm_plan = {f"no-norm,lr={r:g}": {"lr": r, "model": {"norm_placement": "none"}} for r in norm_lrs}
    norm_runs = sweep(out, "no-norm", common, runs=norm_plan)
    beside = [s for s in lr_runs if lr_of(s) in norm_lrs]
    baseline_at = [s for r in norm_lrs for s in renamed([x for x in beside if lr_of(x) == r], f"baseline,lr={r:g}",
                                                        {"lr": r})]  # fmt: skip
    plot(baseline_at + norm_runs, figures / "no-norm.png", title="RMSNorm removed, around the best rate")

    # 3. Post-norm, NoPE and SiLU beside the baseline at the best rate (whose runs are the sweep's at that rate).
    ablations = copy.deepcopy(ABLATIONS)
    ablations["silu"]["model"]["d_ff"] = 4 * MODEL["d_model"]
    ablation_runs = sweep(out, "ablations", {**common, "lr": best_lr}, runs=ablations)
    baseline = renamed([s for s in lr_runs if lr_of(s) == best_lr], "baseline", {})
    plot(baseline + ablation_runs, figures / "ablations.png", title=f"ablations at lr = {best_lr:g}")

    # 4. Batch size at one token budget, the rate re-tuned for each: three rates around the best one scaled by
    # the square root of the batch, the same number of evaluations and the same held-out windows for every size.
    budget = STEPS * BASE["batch_size"] * MODEL["context_length"]
    batch_plan: dict[str, dict[str, Any]] = {}
    for batch in BATCHES:
        steps = budget // (batch * MODEL["context_length"])
        if steps < MIN_STEPS:
            continue
        for factor in (1 / 3, 1, 3):
            lr = float(f"{best_lr * math.sqrt(batch / BASE['batch_size']) * factor:.3g}")
            batch_plan[f"batch={batch},lr={lr:g}"] = {
                "batch_size": batch, "lr": lr, "steps": steps, "eval_interval": max(1, steps // EVALS),
                "checkpoint_interval": steps, "warmup_steps": max(1, steps // 10),
                "eval_batches": max(1, EVAL_WINDOWS // batch),
            }  # fmt: skip
    # One seed per (batch, rate): the rate is tuned on it; the seeds' spread is the learning-rate sweep's.
    batch_runs = sweep(out, "batch", common, runs=batch_plan, seeds=1)
    tuned = []
    for batch in sorted({int(s.settings["batch_size"]) for s in batch_runs}):
        done = [s for s in batch_runs if s.settings["batch_size"] == batch and s.final_val_loss is not None]
        if done:
            tuned.append(min(done, key=lambda s: s.final_val_loss))
    plot(tuned, figures / "batch.png", title="batch size at one token budget, each at its best rate")

    # 5. A sample from the best run (the best rate, seed 0).
    sample_run = next(s for s in lr_runs if lr_of(s) == best_lr and s.final_val_loss is not None)
    argv = ["--max-new-tokens", "256", "--temperature", "0.8", "--top-k", "50", "--json", "--quiet"]
    sample = json.loads(tlm("generate", "--checkpoint", str(out / "lr" / sample_run.path), "--prompt", "The ", *argv))
    return {"n_tokens": n_tokens, "lr_runs": lr_runs, "best_lr": best_lr, "norm_lrs": norm_lrs,
            "baseline_at": baseline_at, "norm_runs": norm_runs, "baseline": baseline, "ablation_runs": ablation_runs,
            "batch_runs": batch_runs, "tuned": tuned, "budget": budget, "sample": sample,
            "sample_run": sample_run.name}  # fmt: skip


# ------------------------------------------------------------------------------------------ the page


def _ms(values: list[float]) -> str:
    from tlm_experiments.stats import describe

    d = describe(values)
    if d.mean is None:
        return "–"
    return f"{d.mean:.3f} ± {d.sd:.3f}" if d.sd is not None else f"{d.mean:.3f}"


def _ended(runs: list[Any]) -> str:
    """How a setting's runs ended: ``2 done, 1 diverged (at step 57)``; ``3 unstable (above 1.5× the start first
    at steps 20, 40, 60)``."""
    parts = []
    for status in ("done", "unstable", "diverged", "interrupted", "failed"):
        these = [r for r in runs if r.status == status]
        if not these:
            continue
        if status == "diverged":
            steps = ", ".join(str(r.diverged_at) for r in these)
            detail = f" (at step{'s' if len(these) > 1 else ''} {steps})"
        elif status == "unstable":
            steps = ", ".join(str(r.unstable_at) for r in these)
            detail = f" (above 1.5× the start first at step{'s' if len(these) > 1 else ''} {steps})"
        elif status == "failed":
            detail = f" ({'; '.join(str(r.message) for r in these)})"
        else:
            detail = ""
        parts.append(f"{len(these)} {status}{detail}")
    return ", ".join(parts)


def _versus(runs: list[Any], base: list[Any]) -> Any:
    """The final loss of ``runs`` against ``base``'s (by seed), or None where either has no finished run."""
    from tlm_experiments.results import Group
    from tlm_experiments.stats import difference

    a, b = Group("a", {}, list(runs)).finals(), Group("b", {}, list(base)).finals()
    return difference(a, b) if a and b else None


def _interval(d: Any) -> str:
    if d is None:
        return "–"
    if d.low is None:
        return f"{d.estimate:+.3f} (one seed: no interval)"
    return f"{d.estimate:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"


def _beyond(d: Any) -> str:
    return "–" if d is None or d.excludes_zero is None else ("yes" if d.excludes_zero else "no")


def _say(d: Any, what: str) -> str:
    from tlm_experiments.stats import verdict

    if d is None:
        return f"{what}: no finished runs to compare"
    return f"{what}: {verdict(d)}"


def page(v: dict[str, Any]) -> str:
    from tlm_experiments.results import group_runs

    lr_runs, best_lr = v["lr_runs"], v["best_lr"]
    lr_groups = group_runs(lr_runs)
    at = {float(g.settings["lr"]): g.runs for g in lr_groups}
    best_runs = at[best_lr]
    base_params = best_runs[0].parameters

    # The learning rate.
    rows = ["| lr | seeds | how the runs ended | final val loss (mean ± sd) | best val loss (mean ± sd) | "
            "final − best rate's [95% interval] | beyond noise? |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for lr, runs in sorted(at.items()):
        d = None if lr == best_lr else _versus(runs, best_runs)
        rows.append(f"| {lr:g} | {', '.join(str(r.seed) for r in runs)} | {_ended(runs)} | "
                    f"{_ms([r.final_val_loss for r in runs if r.final_val_loss is not None])} | "
                    f"{_ms([r.best_val_loss for r in runs if r.finished and r.best_val_loss is not None])} | "
                    f"{'the best' if lr == best_lr else _interval(d)} | "
                    f"{'–' if lr == best_lr else _beyond(d)} |")  # fmt: skip
    lr_table = "\n".join(rows)
    edge = next((lr for lr, runs in sorted(at.items()) if lr > best_lr
                 and any(r.status in ("diverged", "unstable") for r in runs)), None)  # fmt: skip
    diverging = [lr for lr, runs in sorted(at.items()) if any(r.status == "diverged" for r in runs)]
    above = [lr for lr in sorted(at) if lr > best_lr]
    lr_text = (f"The best mean final loss came at lr = {best_lr:g} "
               f"({_ms([r.final_val_loss for r in best_runs if r.final_val_loss is not None])} over "
               f"{len(best_runs)} seeds). ")  # fmt: skip
    near = edge is not None and bool(above) and edge == above[0] and edge / best_lr <= 10
    if edge is not None:
        lr_text += (f"The edge of stability, the smallest rate above it at which a run diverged or went unstable "
                    f"(an evaluation above {1.5:g}× its starting loss), is lr = {edge:g}: {_ended(at[edge])}. "
                    f"The best rate sits {edge / best_lr:g}× below the edge")  # fmt: skip
        lr_text += (", one grid step: as the handout expects, the best rate is near the edge at this scale. "
                    if near else ". ")  # fmt: skip
    else:
        lr_text += "No rate in this grid diverged or went unstable at this scale. "
    if diverging:
        lr_text += f"Runs diverged (their loss stopped being finite) at lr = {', '.join(f'{x:g}' for x in diverging)}. "
    if above:
        lr_text += _say(_versus(at[above[0]], best_runs), f"The next rate up, {above[0]:g}, against the best") + ". "
    below = [lr for lr in sorted(at) if lr < best_lr]
    if below:
        lr_text += _say(_versus(at[below[-1]], best_runs), f"The next rate down, {below[-1]:g}") + "."

    # RMSNorm removed.
    norm_at = {float(g.settings["lr"]): g.runs for g in group_runs(v["norm_runs"])}
    rows = ["| lr | baseline: how the runs ended | no RMSNorm: how the runs ended | no-norm final (mean ± sd) | "
            "no-norm − baseline [95% interval] | beyond noise? |", "|---|---|---|---|---|---|"]  # fmt: skip
    norm_sentences = []
    stable_at: list[float] = []
    for lr in v["norm_lrs"]:
        runs, base = norm_at[lr], at[lr]
        d = _versus(runs, base)
        rows.append(f"| {lr:g}{' (best)' if lr == best_lr else ''} | {_ended(base)} | {_ended(runs)} | "
                    f"{_ms([r.final_val_loss for r in runs if r.final_val_loss is not None])} | {_interval(d)} | "
                    f"{_beyond(d)} |")  # fmt: skip
        if all(r.status == "done" for r in runs):
            stable_at.append(lr)
        where = f"at lr = {lr:g}{' (the best rate)' if lr == best_lr else ''}"
        norm_sentences.append(_say(d, f"{where}, no-norm − baseline"))
    norm_table = "\n".join(rows)
    at_best = norm_at[best_lr]
    unstable_at_best = any(r.status in ("diverged", "unstable") for r in at_best)
    shaky = [lr for lr in v["norm_lrs"] if any(r.status in ("diverged", "unstable") for r in norm_at[lr])]
    base_shaky = [lr for lr in v["norm_lrs"] if any(r.status in ("diverged", "unstable") for r in at[lr])]
    norm_edge = min(shaky) if shaky else None
    norm_edge_lower = norm_edge is not None and (not base_shaky or norm_edge < min(base_shaky))
    if unstable_at_best:
        lower_ok = [lr for lr in stable_at if lr < best_lr]
        norm_text = (f"Without RMSNorm, at the best rate of the baseline ({best_lr:g}): {_ended(at_best)}. "
                     + (f"Lowering the rate restored stability: at lr = {max(lower_ok):g} every seed finished "
                        "without a spike. " if lower_ok else "No lower rate here restored stability. "))  # fmt: skip
    else:
        norm_text = (f"Without RMSNorm, at the baseline's best rate ({best_lr:g}), every run finished without a "
                     f"spike above 1.5× its start ({_ended(at_best)}): at this scale removing the norm did not make "
                     "training unstable. ")  # fmt: skip
    if norm_edge is not None:
        moved = ": removing RMSNorm moved the edge to a lower rate. " if norm_edge_lower else ". "
        norm_text += (f"The edge of stability without the norm is lr = {norm_edge:g} ({_ended(norm_at[norm_edge])}), "
                      f"where the baseline's runs ended {_ended(at[norm_edge])}{moved}")  # fmt: skip
    else:
        norm_text += "No rate tried here made the runs without the norm diverge or go unstable. "
    norm_text += "Final loss, " + "; ".join(norm_sentences) + "."

    # Post-norm, NoPE, SiLU.
    ablation_groups = {g.label: g.runs for g in group_runs(v["ablation_runs"])}
    names = {"post-norm": "post-norm (the norm after each sublayer) vs pre-norm",
             "nope": "NoPE (no position embedding) vs RoPE",
             "silu": "SiLU FFN vs SwiGLU at matched parameters"}  # fmt: skip
    rows = ["| ablation | parameters | how the runs ended | final val loss (mean ± sd) | − baseline [95% interval] "
            "| beyond noise? |", "|---|---|---|---|---|---|",
            f"| baseline (pre-norm, RoPE, SwiGLU) | {base_params:,} | {_ended(best_runs)} | "
            f"{_ms([r.final_val_loss for r in best_runs if r.final_val_loss is not None])} | – | – |"]  # fmt: skip
    ablation_sentences = []
    effects = {}
    for label, what in names.items():
        runs = ablation_groups.get(label, [])
        d = _versus(runs, best_runs)
        effects[label] = d
        rows.append(f"| {what} | {runs[0].parameters:,} | {_ended(runs)} | "
                    f"{_ms([r.final_val_loss for r in runs if r.final_val_loss is not None])} | {_interval(d)} | "
                    f"{_beyond(d)} |")  # fmt: skip
        ablation_sentences.append(_say(d, what))
    ablation_table = "\n".join(rows)
    silu_params = ablation_groups["silu"][0].parameters

    # Batch size.
    rows = ["| batch | steps | rates tried: final val loss | best rate | best final val loss | "
            "wall time of that run (s) |", "|---|---|---|---|---|---|"]  # fmt: skip
    by_batch: dict[int, list[Any]] = {}
    for s in v["batch_runs"]:
        by_batch.setdefault(int(s.settings["batch_size"]), []).append(s)
    tuned = {int(s.settings["batch_size"]): s for s in v["tuned"]}
    for batch, runs in sorted(by_batch.items()):
        tried = "; ".join(f"{lr_of(r):g}: " + (f"{r.final_val_loss:.3f}" if r.final_val_loss is not None else
                                               r.status) for r in sorted(runs, key=lr_of))  # fmt: skip
        t = tuned.get(batch)
        best = f"{lr_of(t):g} | {t.final_val_loss:.3f} | {t.wall_time_s:.0f}" if t else "– | – | –"
        rows.append(f"| {batch} | {runs[0].planned_steps} | {tried} | {best} |")
    batch_table = "\n".join(rows)
    tuned_lrs = [lr_of(tuned[b]) for b in sorted(tuned)]
    grows = all(x <= y for x, y in itertools.pairwise(tuned_lrs))
    spread = _seed_sd(lr_groups)
    best_batch = min(tuned.values(), key=lambda s: s.final_val_loss) if tuned else None
    batch_text = (
        ("The tuned rate grew with the batch (" if grows else "The tuned rate did not grow steadily with the batch (")
        + ", ".join(f"batch {b}: {lr_of(tuned[b]):g}" for b in sorted(tuned)) + "). "
        + (f"The lowest final loss came at batch {best_batch.settings['batch_size']} "
           f"({best_batch.final_val_loss:.3f}). " if best_batch else "")
        + (f"One seed per batch and rate: differences below about {2 * spread:.3f} (twice the seeds' standard "
           "deviation in the learning-rate sweep) are within noise. " if spread else "")
    )  # fmt: skip

    # The handout's expected effects.
    d_up = _versus(at[above[0]], best_runs) if above else None
    effect_rows = [
        ("a rate too large diverges", f"diverged at lr ≥ {diverging[0]:g}" if diverging else "none diverged",
         "yes" if diverging else "no"),
        ("the best rate sits near the edge of stability",
         f"best {best_lr:g}, edge {edge:g} ({edge / best_lr:g}×)" if edge else "no edge in the grid",
         "yes" if near else "no"),
        ("the next rate up is worse", _interval(d_up), "yes" if d_up and d_up.excludes_zero and d_up.estimate > 0
         else "no (within noise)" if d_up else "–"),
        ("no RMSNorm is unstable at the best rate", _ended(at_best), "yes" if unstable_at_best else "no"),
        ("no RMSNorm is unstable at a rate the baseline trains at",
         f"no-norm's edge {norm_edge:g}, the baseline's {min(base_shaky):g}" if norm_edge and base_shaky else
         f"no-norm's edge {norm_edge:g}, none for the baseline here" if norm_edge else "no edge without the norm",
         "yes" if norm_edge_lower else "no"),
        ("a lower rate restores stability without RMSNorm",
         f"stable at lr = {', '.join(f'{x:g}' for x in stable_at)}" if stable_at else "no rate stable",
         ("yes" if any(x < best_lr for x in stable_at) else "no") if unstable_at_best else "– (it was stable)"),
        ("post-norm is worse than pre-norm", _interval(effects["post-norm"]), _shown(effects["post-norm"])),
        ("NoPE is worse than RoPE", _interval(effects["nope"]), _shown(effects["nope"])),
        ("SwiGLU beats SiLU at matched parameters", _interval(effects["silu"]), _shown(effects["silu"])),
        ("a larger batch wants a larger rate", ", ".join(f"{b}: {lr_of(tuned[b]):g}" for b in sorted(tuned)),
         "yes (one seed each)" if grows and len(tuned) > 1 else "no"),
    ]  # fmt: skip
    effect_table = "\n".join(["| effect the handout expects | here | showed beyond noise? |", "|---|---|---|",
                              *(f"| {a} | {b} | {c} |" for a, b, c in effect_rows)])  # fmt: skip

    made = v["made"]
    last_jobs = made["session"]["jobs"]
    jobs = f"runs {last_jobs} at a time" if last_jobs else "tlm sweep's default --jobs: one 1-thread run per CPU thread"
    minutes = made["minutes"]
    per_sweep = ", ".join(f"{name} {m:.1f}" for name, m in made["sweeps"].items())
    n_runs = len(lr_runs) + len(v["norm_runs"]) + len(v["ablation_runs"]) + len(v["batch_runs"])
    text = v["sample"].get("text") or v["sample"].get("completion") or json.dumps(v["sample"])
    epochs = STEPS * BASE["batch_size"] * MODEL["context_length"] / (v["n_tokens"] * 0.9)
    f = v["figures"]
    return f"""# Experiments at CPU scale

<!-- Generated by `nox -s experiments` (tools/make_experiments_doc.py) from the runs it makes. Do not edit by hand. -->

CS336 assignment 1 asks for a learning-rate sweep to divergence, RMSNorm removed, post-norm, NoPE and SiLU
against the baseline, a batch-size sweep and a sample. This page is those experiments at the scale of a CPU,
each setting run with {SEEDS} seeds (the seed sets the initial weights and the batches) so that an effect can be
told from noise: every difference below is the mean over seeds with its 95% interval (Student's t, paired by
seed), and a sentence says *no difference beyond noise* when the interval holds zero. Every sentence that
states a result is generated from the numbers. All results are **the effect at this scale**; the course's models
are a thousand times larger.

Machine: **{cpu()}**. The whole page, {n_runs} runs, took **{minutes:.1f} minutes** to make in
total, summed over the invocations that made its runs (minutes per sweep: {per_sweep}; {jobs}; load average
{made["session"]["load"]:.1f} when the last invocation began).
Wall times and tokens/s move with the load; losses do not (each run is deterministic given its seed).

**Setup.** Corpus: Python's own pydoc topics (`pydoc_data.topics`, shipped with CPython), {v["n_tokens"]:,}
tokens under a {VOCAB}-token byte-level BPE trained on it; the last 10% held out. Model: {MODEL["num_layers"]}
blocks, d_model {MODEL["d_model"]}, {MODEL["num_heads"]} heads, context {MODEL["context_length"]}, SwiGLU
d_ff {MODEL["d_ff"]} ({base_params:,} parameters); AdamW **without gradient clipping or weight decay** (so
that nothing but the rate and the architecture holds a run back), warm-up over the first 10% of steps, then
cosine; {STEPS} steps of {BASE["batch_size"]} × {MODEL["context_length"]} tokens unless said otherwise
({epochs:.1f} passes over the training tokens). Validation loss: the mean cross-entropy (nats/token) over the
same {EVAL_WINDOWS} held-out windows, {EVALS} times per run. How a run ended: *done*; *diverged* (its loss
stopped being finite, at the step named); *unstable* (finished, but an evaluation exceeded 1.5× its starting
loss); *interrupted* (resumable, not a result); *failed*.

In the figures, every evaluation of every run is a marker; a setting with several seeds has its mean curve
(thick) in a min–max band. The loss axes hold the range of the runs that ended *done*: a run that left it is
marked ▲ at the evaluation that did, a diverged run × at the step it diverged. The right panel gives each
setting's final loss, mean ± sd, each seed a dot, on an axis that starts where the data does. The caption
under each figure names its runs, seeds and steps.

## Learning rate

{lr_table}

![validation loss by step and by wall-clock time, and final loss by learning rate, 3 seeds each]({f}/lr.png)

{lr_text}

## Removing RMSNorm

{norm_table}

![baseline and no-norm at the best rate, two rates below and two above]({f}/no-norm.png)

{norm_text}

## Post-norm, NoPE, SiLU

{ablation_table}

![the baseline and the three ablations at the best rate, 3 seeds each]({f}/ablations.png)

At lr = {best_lr:g}, the baseline's runs being the learning-rate sweep's at that rate (the same settings and
seeds). {"; ".join(ablation_sentences)}. The SiLU FFN (two matrices at d_ff = 4·d_model) is matched to SwiGLU
(three at d_ff ≈ 8/3·d_model) in parameters: {silu_params:,} against {base_params:,}, on the same tokens.

## Batch size

{batch_table}

![each batch size at its best rate, by step and by wall-clock time]({f}/batch.png)

Every batch size trained on the same {v["budget"]:,} tokens, from 1 up to the largest that leaves at least
{MIN_STEPS} optimizer steps in that budget (on the CPU memory is not the limit; the budget is), each with three
rates: the best rate above scaled by √(batch / {BASE["batch_size"]}), and that ÷3 and ×3; the figure shows each
size at its best. {batch_text}Wall times were measured with runs sharing the CPU and include the evaluations.

## Sample

256 tokens from {v["sample_run"]} (`tlm generate --checkpoint RUN --prompt "The " --max-new-tokens 256
--temperature 0.8 --top-k 50`):

```text
{text.strip()}
```

## What showed, and what did not

{effect_table}

*Showed* means the 95% interval of the difference excludes zero, in the direction the handout expects (or, for
stability, that the statuses say so). These are {STEPS}-step runs of a {base_params / 1e6:.1f} M-parameter model
on a {v["n_tokens"] / 1e6:.2f} M-token corpus: an effect that shows only late in training or at scale cannot
show here, and one that shows here need not hold at the course's scale. The sample shows what the model learned
of the corpus's words and layout, not fluent English.
"""


def _seed_sd(groups: list[Any]) -> float | None:
    from tlm_experiments.stats import describe

    sds = [describe(g.finals().values()).sd for g in groups if all(r.status == "done" for r in g.runs)]
    sds = [x for x in sds if x is not None]
    return sorted(sds)[len(sds) // 2] if sds else None


def _shown(d: Any) -> str:
    if d is None or d.excludes_zero is None:
        return "–"
    if d.excludes_zero and d.estimate > 0:
        return "yes"
    if d.excludes_zero:
        return "no: the opposite, beyond noise"
    return "no (within noise)"


if __name__ == "__main__":
    sys.exit(main())
