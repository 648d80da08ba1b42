"""How long a checkpoint holds training up, and the host memory it takes: `tlm train` with its checkpoints
written inline (``--no-async-checkpoint``, what every save did before issue 33) against the background writer
(the default), each in a fresh process, same run otherwise.

    python bench/checkpoint_stall.py [--steps N] [--preset NAME]   # writes the "checkpoint_stall" doc section
    python bench/checkpoint_stall.py --sharded [--repeats 3]       # the "checkpoint_stall_sharded" section

Each run logs every step (``log_interval=1``), so ``metrics.jsonl``'s ``time_s`` gives every step's wall time;
a save happens after step 4 and step 8 of 12. "Stall" is the wall time from the end of a saving step to the end
of the next, minus the median of the steps that follow no save. Peak memory is the process's high-water RSS
(VmHWM, reset just before the first save through ``/proc/self/clear_refs``) above the RSS just before it, read
once that save is on disk.

``--sharded``: the same on two FSDP2 ranks (``torchrun``, gloo, one thread a rank), a small model, the sharded
(DCP) save inline (``--no-async-checkpoint``) against ``dcp.async_save`` (the default) written by DCP's thread
and by DCP's writer process (``BackgroundSaver``'s ``writer``), the three alternating,
``--repeats`` fresh runs each. Saves follow steps 4 and 8 of 10: the first one's memory is measured (each rank's
high-water RSS above its RSS before, waiting for the save to be on disk), the second one's stall (the two steps
after it, which a background save overlaps, against twice the median of the steps after no save), so the first
save's wait never counts as a stall.
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

# Guarded by __main__: DCP's writer process starts with spawn, which imports this script again (issue 42).
CHILD = r"""
import functools, json, os, sys, time, numpy as np, torch
from tlm_train import TrainConfig, train
import tlm_train.recipe as recipe

def status():
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields

memory = {}
original = recipe.Recipe.maybe_checkpoint
wait = False

def measured(self, step, sampler_state, *, force=False):
    saving = force or step % self.config.checkpoint_interval == 0 or step == self.steps
    if saving and "before" not in memory:
        from torch.distributed.tensor import DTensor
        tensors = [*self.model.state_dict().values(),
                   *(v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
        memory["state"] = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        memory["before"] = status()["VmRSS"]
        original(self, step, sampler_state, force=force)
        if wait:
            self.saver.wait()
        memory["peak"] = status()["VmHWM"]
        return
    began = time.perf_counter()
    original(self, step, sampler_state, force=force)
    if saving:  # the time the loop spends in the save call itself (the later saves)
        memory.setdefault("call_s", {})[str(step)] = time.perf_counter() - began

if __name__ == "__main__":
    torch.set_num_threads(1)  # training on one core; a background writer may use the other
    settings = json.loads(sys.argv[1])
    wait = settings.pop("measure_memory", False)
    memory_out = settings.pop("memory_out", None)  # sharded: each rank writes its figures to memory_out.RANK
    # sharded: the async save's writer, DCP's process or its thread (BackgroundSaver's writer)
    recipe.BackgroundSaver = functools.partial(recipe.BackgroundSaver, settings.pop("writer", "auto"))
    recipe.Recipe.maybe_checkpoint = measured
    train(TrainConfig(**settings))
    if memory_out is None:
        print(json.dumps(memory))
    else:
        with open(f"{memory_out}.{os.environ.get('RANK', '0')}", "w") as out:
            json.dump(memory, out)
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


def run_sharded(settings: dict, tmp: pathlib.Path) -> tuple[list[float], list[dict]]:
    """One 2-rank FSDP2 run under torchrun: its step intervals (rank 0's metrics.jsonl) and each rank's memory."""
    script = tmp / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run([*launcher, str(script), json.dumps(settings)], capture_output=True, text=True, env=env,
                          timeout=600, check=False)  # fmt: skip
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    records = [json.loads(x) for x in (pathlib.Path(settings["out_dir"]) / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time_s"] for r in records if "train_loss" in r}
    steps = sorted(times)
    memory = [json.loads(pathlib.Path(f"{settings['memory_out']}.{rank}").read_text()) for rank in (0, 1)]
    return [times[s] - times[p] for p, s in itertools.pairwise(steps)], memory


def main_sharded(args: argparse.Namespace) -> None:
    import numpy as np
    from _common import cpu_description, load_average, write_section

    model = {"d_model": 256, "num_layers": 4, "num_heads": 4, "d_ff": 704, "context_length": 128}
    rows: dict[str, dict[str, list[float]]] = {m: {"step_s": [], "call_s": [], "stall_s": [], "peak_mib": []}
                                               for m in MODES}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tlm-stall-") as name:
        tmp = pathlib.Path(name)
        tokens = tmp / "tokens.npy"
        np.save(tokens, np.random.default_rng(0).integers(0, 10_000, 200_000).astype(np.uint16))
        load_before, state_mib = load_average(), 0.0
        for repeat, mode in itertools.product(range(args.repeats), MODES):
            settings = {"data": [str(tokens)], "vocab_size": 10_000, "model": model, "batch_size": 4, "steps": 10,
                        "warmup_steps": 1, "log_interval": 1, "eval_interval": 10_000, "eval_batches": 1,
                        "checkpoint_interval": 4, "keep_checkpoints": 5, "sample_tokens": 0, "peak_flops": 1e12,
                        "async_checkpoint": mode != "inline", "distributed": "fsdp", "measure_memory": True,
                        "writer": "process" if mode == "async, process" else "thread",
                        "out_dir": str(tmp / f"{mode}-{repeat}"),
                        "memory_out": str(tmp / f"{mode}-{repeat}.memory")}  # fmt: skip
            intervals, memory = run_sharded(settings, tmp)
            # intervals[i] ends at step i + 2: the first save (waited for) follows step 4, the second step 8; a
            # background save of step 8 overlaps steps 9 and 10, so the stall is theirs together over two steps.
            normal = [t for i, t in enumerate(intervals) if i + 2 not in (5, 9, 10)]
            base = statistics.median(normal)
            rows[mode]["step_s"].append(base)
            rows[mode]["stall_s"].append(intervals[9 - 2] + intervals[10 - 2] - 2 * base)
            rows[mode]["call_s"].append(memory[0]["call_s"]["8"])  # rank 0's, which finishes the folder
            rows[mode]["peak_mib"].append(max(m["peak"] - m["before"] for m in memory) / 2**20)
            state_mib = max(m["state"] for m in memory) / 2**20  # the larger rank's part of the state
            print(mode, repeat, {k: v[-1] for k, v in rows[mode].items()}, flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_description(), "load": (load_before, load_average())}  # fmt: skip
    from tlm_model import TransformerLM
    from tlm_train import TrainConfig

    shape = TrainConfig(vocab_size=10_000, model=model).model_config(10_000)
    count = sum(p.numel() for p in TransformerLM(shape, device="meta").parameters())
    params = f"{count / 1e6:.1f}M parameters (d_model 256, 4 layers, vocabulary 10,000)"
    lines = [
        "## Checkpoint stall, sharded: DCP inline vs `dcp.async_save`, its writer a thread or a process (2 FSDP2 "
        "ranks)",
        "",
        f"Measured {meta['date']} on {meta['cpu']}, two gloo ranks of one thread each (`torchrun`); **the machine "
        f"was shared and busy** (1-minute load average {meta['load'][0]:.1f} before, {meta['load'][1]:.1f} after). "
        f"{params}, batch 4, 10 steps, a sharded checkpoint (each rank's half of the weights and AdamW state, "
        f"{state_mib:.0f} MiB) after steps 4 and 8; {args.repeats} fresh runs per mode, alternating. Each cell: median "
        "[min, max] over the runs.",
        "",
        "| save | median step (s) | the save call, rank 0 (s) | stall: the save and the 2 steps after it, above 2 "
        "steps (s) | peak RSS in a save above before, the larger rank (MiB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]

    def cell(values: list[float], sign: str = "") -> str:
        return f"{statistics.median(values):{sign}.2f} [{min(values):{sign}.2f}, {max(values):{sign}.2f}]"

    for mode, r in rows.items():
        peak = r["peak_mib"]
        lines.append(
            f"| {mode} | {cell(r['step_s'])} | {cell(r['call_s'])} | {cell(r['stall_s'], '+')} | "
            f"{statistics.median(peak):,.0f} [{min(peak):,.0f}, {max(peak):,.0f}] |"
        )
    inline = statistics.median(rows["inline"]["stall_s"])
    ratios = "; ".join(f"{mode}: {statistics.median(rows[mode]['stall_s']) / inline:.2f}×" for mode in MODES[1:])
    lines += [
        "",
        "The save call is what the loop waits for: inline, DCP's whole write and rank 0's hashing and rename; async, "
        "the start of the copy of each rank's part to host memory (DCP's staging thread, `DefaultStager` with "
        "`use_async_staging=True`; the step waits for the copy only just before its optimizer update) and DCP's "
        "start. The writer is DCP's thread in this process, or DCP's writer process "
        "(`AsyncCheckpointerType.PROCESS`, one a rank, spawned at the first save and reading the staged copy from "
        "shared memory), which `tlm train` takes for an accelerator's state (forced here on the CPU). The "
        "stall is the whole bill, the call included: here two ranks train on the machine's two cores, so the "
        "background writers take their CPU time from the steps they overlap whether they are threads or "
        f"processes: the totals against inline's are {ratios} (medians). On a host with idle cores (a GPU host) "
        "that CPU time would be free and the call the stall (not measured here). An async save holds each rank's "
        "snapshot (its part of the state) until it is written; the RSS peak is this process's (a writer process's "
        "own memory is not in it) and shows less where the allocator reuses memory the step had freed.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "meta": meta, "text": text}))
    if not args.print_only:
        write_section("checkpoint_stall_sharded", text, args.out)


MODES = ("inline", "async, thread", "async, process")  # --sharded: async_save's writer, DCP's thread or process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--preset", default="course-tinystories")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--print-only", action="store_true")
    parser.add_argument("--device", default="cpu", help="cuda: the GPU check's part (bench/gpu.py)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="two FSDP2 ranks: DCP inline vs dcp.async_save (thread and process writers)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="--sharded: fresh runs per mode")
    args = parser.parse_args()
    if args.sharded:
        main_sharded(args)
        return
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
