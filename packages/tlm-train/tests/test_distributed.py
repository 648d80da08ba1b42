"""torchrun with 2 gloo processes: DDP and FSDP2 equal one process on the same global batch, a
2-process run resumes bit-exactly, each rank writes its own DCP shards, and a 2-rank checkpoint resumes
on 1 rank (all slow); and, quickly,
what the helpers do in one process without torchrun.

Tolerance: the ranks' gradients are averaged by an all-reduce (FSDP2: a reduce-scatter) instead of
one mean over the whole batch, a different float32 summation order. After STEPS AdamW steps at
lr 3e-3 that moves weights by a few float32 ulps (measured: 1.2e-7 on weights of magnitude ~1);
ATOL = 1e-5 is far below one optimizer update (~lr = 3e-3), so a wrong batch split, a missing
gradient sync or a wrong loss scale (all of which change weights by ~lr) cannot pass.
"""

import errno
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tlm_train.distributed
from tlm_artifacts.steps import read_model_state
from tlm_model import ModelConfig, TransformerLM
from tlm_train import DistInfo, LanguageModelLoss, RunDir, TrainConfig, init_distributed, train, wrap_model
from tlm_train.distributed import barrier
from tlm_train.metrics import TIMING_FIELDS

STEPS = 6
ATOL = 1e-5
SETTINGS = dict(
    vocab_size=48, batch_size=8, grad_accum=2, steps=STEPS, warmup_steps=2, eval_interval=3, eval_batches=2,
    checkpoint_interval=2, keep_checkpoints=10, seed=3, peak_flops=1e9, sample_tokens=0,
    model={"context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64},
)  # fmt: skip
SCRIPT = """
import json, sys
from tlm_train import TrainConfig, train
settings = json.loads(sys.argv[1])
resume = settings.pop("resume", False)
train(TrainConfig(**settings), resume=resume)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


def _train(tokens: Path, out: Path, nproc: int = 1, **changes) -> None:
    settings = {**SETTINGS, "data": [str(tokens)], "out_dir": str(out), **changes}
    if nproc == 1:
        # In this process, on one thread like each torchrun rank: a new interpreter would only add its
        # seconds of importing torch.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            settings = json.loads(json.dumps(settings))  # what the script would read from its argv
            resume = settings.pop("resume", False)
            train(TrainConfig(**settings), resume=resume)
        finally:
            torch.set_num_threads(threads)
        return
    script = out.parent / "train_script.py"
    script.write_text(SCRIPT)
    # torchrun itself, as a user would launch it
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    done = subprocess.run([*launcher, str(script), json.dumps(settings)], env=_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def _weights(run: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return read_model_state(RunDir(run).checkpoints().path(step))[1]


def _metrics(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in lines]


def _flat(state: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> torch.Tensor:
    """``state``'s tensors end to end in ``like``'s key order (checkpoints read back in different orders)."""
    return torch.cat([state[k].flatten() for k in like])


def _max_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.tile(rng.integers(0, 48, 40), 30).astype(np.uint16))
    return path


@pytest.fixture(scope="module")
def single(tokens: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    _train(tokens, out)
    return out


@pytest.fixture(scope="module")
def fsdp(tokens: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp") / "run"
    _train(tokens, out, nproc=2, distributed="fsdp", activation_checkpointing=True)
    return out


@pytest.mark.slow
def test_ddp_on_two_processes_equals_one_process(tokens: Path, single: Path, tmp_path: Path, record_error) -> None:
    out = tmp_path / "run"
    _train(tokens, out, nproc=2, distributed="ddp")
    got, want = _weights(out), _weights(single)
    record_error("DDP x2 vs 1 process, weights after 6 steps", _flat(got, want), _flat(want, want))
    assert _max_error(got, want) <= ATOL
    for a, b in zip(_metrics(out), _metrics(single), strict=True):
        assert a.keys() == b.keys() and a["step"] == b["step"]
        for key in ("train_loss", "val_loss", "grad_norm"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5)


@pytest.mark.slow
def test_fsdp2_on_two_processes_equals_one_process(fsdp: Path, single: Path, record_error) -> None:
    got, want = _weights(fsdp), _weights(single)
    name = "FSDP2 x2 (+activation checkpointing) vs 1 process, weights after 6 steps"
    record_error(name, _flat(got, want), _flat(want, want))
    assert _max_error(got, want) <= ATOL


@pytest.mark.slow
def test_two_process_fsdp2_resume_is_bit_identical(tokens: Path, fsdp: Path, tmp_path: Path) -> None:
    # A crash after the step-2 checkpoint: later checkpoints never written, metrics written past it.
    out = tmp_path / "run"
    shutil.copytree(fsdp, out)
    for step in RunDir(out).checkpoints().steps():
        if step > 2:
            shutil.rmtree(RunDir(out).checkpoints().path(step))
    _train(tokens, out, nproc=2, distributed="fsdp", activation_checkpointing=True, resume=True)
    got, want = _weights(out), _weights(fsdp)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert _metrics(out) == _metrics(fsdp)


@pytest.mark.slow
def test_each_rank_writes_its_own_shards_and_dcp_reads_them_back_whole(fsdp: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = RunDir(fsdp).checkpoints().path(4)
    assert sorted(p.name for p in folder.iterdir()) == ["shards", "train_state.pt"]  # no gathered model file
    assert sorted(p.name for p in (folder / "shards").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # DCP's own index of the files: every tensor (weights and both AdamW moments) is in two halves by rows,
    # rank 0's half in rank 0's file and rank 1's in rank 1's; no file holds a whole tensor.
    metadata = FileSystemReader(folder / "shards").read_metadata()
    parts: dict[str, dict[str, int]] = {}
    for index, info in metadata.storage_data.items():
        parts.setdefault(index.fqn, {})[info.relative_path] = index.offset[0]
    tensors = {k: v.size for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    assert len(tensors) == 3 * len(_weights(fsdp, 4))
    for key, size in tensors.items():
        assert parts[key] == {"__0_0.distcp": 0, "__1_0.distcp": size[0] // 2}, key
    # What tlm's commands read equals DCP's own consolidation of the same files.
    dcp_to_torch_save(folder / "shards", tmp_path / "consolidated.pt")
    whole = torch.load(tmp_path / "consolidated.pt", weights_only=True)
    want = {key.removeprefix("model."): value for key, value in whole.items() if key.startswith("model.")}
    got = read_model_state(folder)[1]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_rank(tokens: Path, fsdp: Path, single: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(fsdp, out)
    for step in RunDir(out).checkpoints().steps():
        if step > 4:
            shutil.rmtree(RunDir(out).checkpoints().path(step))
    _train(tokens, out, distributed="none", activation_checkpointing=True, resume=True)
    assert _max_error(_weights(out), _weights(single)) <= ATOL


def test_without_torchrun_one_process_and_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = init_distributed("cpu")
    assert info == DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")) and info.is_main
    assert not torch.distributed.is_initialized()
    assert barrier() is None  # no group: nothing to wait for, and no error


def test_wrap_model_checks_its_mode() -> None:
    model = TransformerLM(ModelConfig(48, 8, 16, 1, 2, 24), fused=False)
    with pytest.raises(ValueError, match=r"^mode must be one of \['ddp', 'fsdp', 'none'\], got 'zero'$"):
        wrap_model(model, "zero")
    with pytest.raises(ValueError, match="distributed mode 'ddp' needs a process group"):
        wrap_model(model, "ddp")
    wrapped = wrap_model(model, "none")
    assert isinstance(wrapped, LanguageModelLoss) and wrapped.model is model


def test_compile_is_applied_to_each_block_in_place_before_wrapping(monkeypatch) -> None:
    # torchtitan's order (checkpointing, compile, then fully_shard), in place: the state-dict keys stay.
    order = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: order.append(("compile", self)))
    monkeypatch.setattr(tlm_train.distributed, "LanguageModelLoss", lambda m, **k: order.append(("wrap", m)) or m)
    model = TransformerLM(ModelConfig(48, 8, 16, 2, 2, 24), fused=False)
    keys = list(model.state_dict())
    wrap_model(model, "none", compile=True)
    assert order == [("compile", model.layers[0]), ("compile", model.layers[1]), ("wrap", model)]
    assert list(model.state_dict()) == keys


MIXED_SCRIPT = """
import json, sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
from tlm_model import ModelConfig
from tlm_optim import AdamW
from tlm_train import TrainConfig, init_distributed, train, train_step, wrap_model
from tlm_train.distributed import build_model

class Collectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = {}
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            dtypes = {str(t.dtype) for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()}
            self.seen.setdefault(func.__name__.split(".")[0], set()).update(dtypes)
        return func(*args, **(kwargs or {}))

info = init_distributed("cpu")
model = build_model(ModelConfig(48, 16, 32, 2, 2, 64), "cpu", seed=3)
loss_module = wrap_model(model, "fsdp", param_dtype=torch.bfloat16)
seen_dtypes = []
model.layers[0].attn.register_forward_pre_hook(lambda m, a: seen_dtypes.append(str(next(m.parameters()).dtype)))
optimizer = AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 48, (2, 17), generator=torch.Generator().manual_seed(info.rank))
with Collectives() as c:
    stats = train_step(loss_module, optimizer, [(ids[:, :-1], ids[:, 1:])], autocast_dtype=torch.bfloat16)
out = {"collectives": {k: sorted(v) for k, v in c.seen.items()}, "forward_params": seen_dtypes,
       "params": sorted({str(p.dtype) for p in model.parameters()}),
       "grads": sorted({str(p.grad.dtype) for p in model.parameters()}), "loss": float(stats.loss)}
json.dump(out, open(sys.argv[1] + f".{info.rank}", "w"))
# And the command's path: a whole run with --dtype bfloat16 --distributed fsdp.
settings = json.loads(sys.argv[2])
result = train(TrainConfig(**settings))
assert result.step == settings["steps"]
"""


@pytest.mark.slow
def test_fsdp2_bfloat16_gathers_in_bfloat16_and_reduces_in_float32(tokens: Path, tmp_path: Path) -> None:
    # FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), seen in the collectives each rank ran:
    # the parameters all-gathered (and the blocks run) in bfloat16, the gradients reduce-scattered in float32,
    # and the sharded parameters, their gradients and so the optimizer all in float32. Then a whole 2-step run.
    script = tmp_path / "mixed.py"
    script.write_text(MIXED_SCRIPT)
    run = {**SETTINGS, "data": [str(tokens)], "out_dir": str(tmp_path / "run"), "steps": 2, "eval_interval": 2,
           "checkpoint_interval": 2, "dtype": "bfloat16", "distributed": "fsdp"}  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run([*launcher, str(script), str(tmp_path / "out"), json.dumps(run)], env=_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.{rank}").read_text())
        gathers = [name for name in got["collectives"] if "allgather" in name]
        reduces = [name for name in got["collectives"] if "reduce_scatter" in name]
        assert gathers and reduces, got["collectives"]
        assert all(got["collectives"][name] == ["torch.bfloat16"] for name in gathers), got["collectives"]
        assert all(got["collectives"][name] == ["torch.float32"] for name in reduces), got["collectives"]
        assert got["forward_params"] == ["torch.bfloat16"]
        assert got["params"] == got["grads"] == ["torch.float32"]
        assert math.isfinite(got["loss"])
    assert RunDir(tmp_path / "run").checkpoints().steps() == [2]


FULL_DISK_SCRIPT = """
import errno, json, os, sys
from torch.distributed.checkpoint import FileSystemWriter
from tlm_train import TrainConfig, train
write = FileSystemWriter.write_data

def full(self, *args, **kwargs):  # the disk is full for step 4's shards, on every rank
    if "step_00000004" in str(self.path):
        raise OSError(errno.ENOSPC, "No space left on device")
    return write(self, *args, **kwargs)

FileSystemWriter.write_data = full
try:
    train(TrainConfig(**json.loads(sys.argv[2])))
except OSError as err:
    with open(f"{sys.argv[1]}.{os.environ['RANK']}", "w") as out:
        json.dump({"errno": err.errno, "message": str(err)}, out)
    raise SystemExit(3)
"""


@pytest.mark.slow
def test_a_failed_background_sharded_save_stops_every_rank_with_one_clear_error(tokens: Path, tmp_path: Path) -> None:
    # dcp.async_save of step 4 fails (a full disk) on both ranks while training goes on: every rank raises the
    # same OSError at the same point (a logged step whose all-reduce says the writers are idle, or the next save),
    # nothing hangs, and the run folder keeps step 2 with no step 4 and no temporary folder.
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK_SCRIPT)
    run = {**SETTINGS, "data": [str(tokens)], "out_dir": str(tmp_path / "run"), "distributed": "fsdp"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run([*launcher, str(script), str(tmp_path / "error"), json.dumps(run)], env=_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode != 0
    for rank in (0, 1):
        got = json.loads((tmp_path / f"error.{rank}").read_text())
        assert got["errno"] == errno.ENOSPC
        assert "the checkpoint of step 4 was not written: rank 0, 1 failed: OSError" in got["message"], got
    folder = RunDir(tmp_path / "run").checkpoints().directory
    assert sorted(os.listdir(folder)) == ["latest", "step_00000002"]
