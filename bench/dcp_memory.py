"""Rank 0's peak memory while a 2-rank FSDP2 run saves a checkpoint: gathered full state dicts (tlm-train
0.2) against torch.distributed.checkpoint shards (each rank writes its own part).

Usage: ``python bench/dcp_memory.py [--d-model 512 --layers 8 --vocab 8192]`` from the repository root,
in any venv with torch (the workspace's ``packages/*/src`` are put on the path when tlm is not
installed). It launches ``torchrun --nproc-per-node 2`` (gloo, CPU, one thread a rank) once per way of
saving and writes one table, its section of docs/benchmarks.md (``--print``: print it only); nothing is
timed.

Method. Each rank builds the model, wraps it with FSDP2 (``fully_shard`` per block and on the root),
takes one AdamW step on a random batch so the optimizer holds both moments, and then saves step 1
into a fresh run folder. Just before the save each rank resets its resident-set high-water mark
(``/proc/self/clear_refs`` ← 5, Linux) and reads ``VmRSS``; just after, it reads ``VmHWM``: the peak
resident memory of the save, over what the process already held. ``gathered`` is what tlm-train 0.2
did: ``get_state_dict(full_state_dict=True, cpu_offload=True)`` on every rank, then rank 0 writes
``model.safetensors`` + ``train_state.pt`` from the full model and optimizer state. ``sharded`` is
``capture_state`` + ``CheckpointManager.save`` now: every rank writes its shards through DCP.
"""

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from _common import DOC, cpu_description, write_section

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODES = ("gathered", "sharded")


def _memory() -> dict[str, int]:
    lines = pathlib.Path("/proc/self/status").read_text().splitlines()
    return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in lines) if k in ("VmRSS", "VmHWM")}


def _rank(args: argparse.Namespace) -> None:
    """One rank of the measurement (run under torchrun)."""
    try:
        import tlm_train  # noqa: F401
    except ImportError:
        sys.path.extend(str(p) for p in sorted(ROOT.glob("packages/*/src")))
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from tlm_model import ModelConfig
    from tlm_optim import AdamW
    from tlm_train import CheckpointManager, capture_state
    from tlm_train.distributed import build_model, init_distributed, wrap_model
    from tlm_train.rng import rng_state

    info = init_distributed("cpu")
    heads = max(1, args.d_model // 64)
    config = ModelConfig(args.vocab, 64, args.d_model, args.layers, heads, int(args.d_model * 8 / 3) // 64 * 64)
    model = build_model(config, "cpu", seed=0)
    loss_module = wrap_model(model, "fsdp")
    optimizer = AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, args.vocab, (2, 65), generator=torch.Generator().manual_seed(info.rank))
    loss_module(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    manager = CheckpointManager(pathlib.Path(args.out) / "checkpoints", keep=1)
    dist.barrier()

    pathlib.Path("/proc/self/clear_refs").write_text("5")
    before = _memory()["VmRSS"]
    if args.mode == "gathered":
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(model, optimizer, options=full)
        if info.is_main:
            # What tlm-train 0.2's capture_state returned on rank 0 under FSDP2.
            state = {"step": 1, "model": model_state, "optimizer": optim_state, "scheduler": None, "sampler": None,
                     "rng": rng_state(), "world_size": info.world_size}  # fmt: skip
            manager.save(model, state)
        dist.barrier()
    else:
        manager.save(model, capture_state(model, optimizer, step=1))
    peak = _memory()["VmHWM"]
    report = {"rank": info.rank, "before": before, "peak": peak}
    gathered: list = [None] * info.world_size
    dist.all_gather_object(gathered, report)
    if info.is_main:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"mode": args.mode, "params": params, "ranks": gathered}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--print", action="store_true", help="print the section instead of writing it")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # set for the ranks
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode is not None:
        _rank(args)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for mode in MODES:
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       __file__, "--mode", mode, "--out", out, "--d-model", str(args.d_model), "--layers",
                       str(args.layers), "--vocab", str(args.vocab)]  # fmt: skip
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(done.stderr[-3000:])
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    mib = 2**20
    params = rows[0]["params"]
    whole = 12 * params / mib  # float32 weights + AdamW's two moments
    lines = [
        "## Checkpoint memory: rank 0's peak while a 2-rank FSDP2 run saves",
        "",
        f"Written by `python bench/dcp_memory.py` on {datetime.date.today()}; CPU: {cpu_description()}; torch "
        f"{torch_version()}; torchrun, 2 gloo ranks, one thread each. Model: {params / 1e6:.1f} M parameters "
        f"(d_model {args.d_model}, {args.layers} layers, vocabulary {args.vocab}); its float32 weights and AdamW's "
        f"two moments are {whole:.0f} MiB in all. Each rank takes one AdamW step, then saves step 1. *gathered* is "
        "tlm-train 0.2's save (full state dicts gathered to every rank, rank 0 writes them); *sharded* is "
        "`capture_state` + `CheckpointManager.save` now (each rank writes its own DCP shards). Peak = the "
        "resident-set high-water mark during the save (`VmHWM`, reset just before it) over the RSS just before.",
        "",
        "| save | rank | RSS before (MiB) | peak during save (MiB) | peak − before (MiB) |",
        "|---|---|---:|---:|---:|",
    ]
    for row in rows:
        for rank in row["ranks"]:
            before, peak = rank["before"] / mib, rank["peak"] / mib
            lines.append(f"| {row['mode']} | {rank['rank']} | {before:,.0f} | {peak:,.0f} | {peak - before:,.0f} |")
    text = "\n".join(lines) + "\n"
    if args.print:
        print(text)
    else:
        write_section("checkpoint", text)
        print(f"wrote the checkpoint section of {DOC}")


def torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
