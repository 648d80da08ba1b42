"""How long a checkpoint holds training up, and the host memory it takes: `tlm train` with its checkpoints
written inline (``--no-async-checkpoint``, what every save did before issue 33) against the background writer
(the default), each in a fresh process, same run otherwise.

    python bench/checkpoint_stall.py [--steps N] [--preset NAME]   # writes the "checkpoint_stall" doc section

Each run logs every step (``log_interval=1``), so ``metrics.jsonl``'s ``time_s`` gives every step's wall time;
a save happens after step 4 and step 8 of 12. "Stall" is the wall time from the end of a saving step to the end
of the next, minus the median of the steps that follow no save. Peak memory is the process's high-water RSS
(VmHWM, reset just before the first save through ``/proc/self/clear_refs``) above the RSS just before it, read
once that save is on disk.
"""

import argparse
import datetime
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

CHILD = r"""
import json, os, sys, numpy as np, torch
torch.set_num_threads(1)  # training on one core; a background writer may use the other
from tlm_train import TrainConfig, train
import tlm_train.recipe as recipe

def status():
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields

settings = json.loads(sys.argv[1])
wait = settings.pop("measure_memory", False)
memory = {}
original = recipe.Recipe.maybe_checkpoint

def measured(self, step, sampler_state, *, force=False):
    saving = force or step % self.config.checkpoint_interval == 0 or step == self.steps
    if saving and "before" not in memory:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        memory["before"] = status()["VmRSS"]
        original(self, step, sampler_state, force=force)
        if wait:
            self.saver.wait()
        memory["peak"] = status()["VmHWM"]
        return
    original(self, step, sampler_state, force=force)

recipe.Recipe.maybe_checkpoint = measured
train(TrainConfig(**settings))
print(json.dumps(memory))
"""


def run(settings: dict) -> tuple[list[float], dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(settings)], capture_output=True, text=True,
                          env=env, timeout=600, check=False)  # fmt: skip
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    records = [json.loads(x) for x in (pathlib.Path(settings["out_dir"]) / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time_s"] for r in records if "train_loss" in r}
    steps = sorted(times)
    intervals = [times[s] - times[p] for p, s in itertools.pairwise(steps)]  # interval ending at step s
    return intervals, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--preset", default="course-tinystories")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--print-only", action="store_true")
    parser.add_argument("--device", default="cpu", help="cuda: the GPU check's part (bench/gpu.py)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    args = parser.parse_args()
    import numpy as np
    from _common import cpu_description, load_average, write_section

    rows = {}
    with tempfile.TemporaryDirectory(prefix="tlm-stall-") as tmp:
        tokens = pathlib.Path(tmp) / "tokens.npy"
        np.save(tokens, np.random.default_rng(0).integers(0, 10_000, 200_000).astype(np.uint16))
        load_before = load_average()
        for mode in ("inline", "background"):
            settings = {"data": [str(tokens)], "vocab_size": 10_000, "preset": args.preset, "batch_size": 2,
                        "steps": args.steps, "warmup_steps": 1, "log_interval": 1, "eval_interval": 10_000,
                        "eval_batches": 1, "checkpoint_interval": 4, "keep_checkpoints": 5, "sample_tokens": 0,
                        "peak_flops": 1e12, "async_checkpoint": mode == "background",
                        "device": args.device}  # fmt: skip
            intervals, _ = run({**settings, "out_dir": f"{tmp}/{mode}"})
            _, memory = run({**settings, "out_dir": f"{tmp}/{mode}-memory", "measure_memory": True})
            # intervals[i] ends at step i + 2; a save follows steps 4 and 8, so the intervals ending at 5 and 9.
            after_save = [intervals[s - 2] for s in (5, 9) if s - 2 < len(intervals)]
            normal = [t for i, t in enumerate(intervals) if i + 2 not in (5, 9)]
            base = statistics.median(normal)
            rows[mode] = {"step_s": base, "after_save_s": after_save, "stall_s": [t - base for t in after_save],
                          "peak_mib": (memory["peak"] - memory["before"]) / 2**20}  # fmt: skip
            print(mode, rows[mode], flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_description(), "load": (load_before, load_average())}  # fmt: skip
    where = meta["cpu"] if args.device == "cpu" else args.device
    lines = [
        "## Checkpoint stall: a save inline vs on the background writer",
        "",
        f"Measured {meta['date']} on {where}, training on one thread; **the machine was shared and busy** "
        f"(1-minute load average {meta['load'][0]:.1f} before, {meta['load'][1]:.1f} after). `{args.preset}` preset, "
        f"batch 2, {args.steps} steps, a checkpoint (weights + AdamW state, ~12 bytes a parameter) after steps 4 "
        "and 8; each mode a fresh process.",
        "",
        "| save | median step (s) | step after each save (s) | stall (s) | peak RSS in a save, above before (MiB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for mode, r in rows.items():
        lines.append(
            f"| {mode} | {r['step_s']:.2f} | {', '.join(f'{t:.2f}' for t in r['after_save_s'])} | "
            f"{', '.join(f'{t:+.2f}' for t in r['stall_s'])} | {r['peak_mib']:,.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "meta": meta, "text": text}))
    if not args.print_only:
        write_section("checkpoint_stall", text, args.out)


if __name__ == "__main__":
    main()
