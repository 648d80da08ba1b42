"""A sharded (DDP/FSDP2) step's DCP files, read by tlm-artifacts itself: their sizes, their tensors, and a LoRA
run's sharded step, whose adapters are in the shards instead of ``adapter.safetensors``."""

import hashlib
import os
import warnings
from pathlib import Path

import torch

from tlm_artifacts import load_model, resolve
from tlm_artifacts.steps import read_sharded_tensors, shard_sizes


def _write_shards(folder, tensors):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: one process is meant
        dcp.save({f"model.{k}": v for k, v in tensors.items()}, storage_writer=FileSystemWriter(folder / "shards"),
                 no_dist=True)  # fmt: skip
    files = {}
    for root, _, names in os.walk(folder / "shards"):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, folder / "shards")] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return files


def test_a_sharded_steps_sizes_and_tensors_are_what_was_saved(tmp_path, writers):
    model = writers.model(3)
    folder = writers.write_step(tmp_path / "step_00000003", model, 3, sharded=True)
    state = model.state_dict()
    assert shard_sizes(folder / "shards") == {f"model.{k}": (tuple(v.shape), v.dtype) for k, v in state.items()}
    read = read_sharded_tensors(folder)
    assert read.keys() == state.keys() and all(torch.equal(read[k], state[k]) for k in state)


def test_a_lora_runs_sharded_step_opens_as_its_base_with_the_sharded_adapters_merged(tmp_path, writers):
    from tlm_lora import merged_state_dict
    from tlm_model import save_model_file

    base = writers.model(1)
    save_model_file(base, tmp_path / "base")
    adapted, lora = writers.lora_step(base, tmp_path / "base")
    folder = tmp_path / "run" / "checkpoints" / "step_00000003"
    folder.mkdir(parents=True)
    files = _write_shards(folder, {k: v for k, v in adapted.state_dict().items() if ".lora_" in k})
    writers.write_state(folder / "train_state.pt", {"step": 3, "lora": lora, "shard_files": files,
                                                    "model_config": base.config.to_dict()})  # fmt: skip
    loaded, step = load_model(resolve(folder), dtype=torch.float32)
    want = merged_state_dict(adapted.eval())
    assert step == 3
    assert all(torch.allclose(loaded.state_dict()[k], want[k], atol=1e-6) for k in want)
    assert not torch.allclose(want["layers.0.attn.q_proj.weight"], base.state_dict()["layers.0.attn.q_proj.weight"])
