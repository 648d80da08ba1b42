"""Fixtures for tlm-artifacts' tests: step and run folders written here from the formats' descriptions (not by
tlm-train, which this package must not need), so the readers are checked against a writer of their own."""

import hashlib
import io
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tlm_artifacts.train_state import FORMAT, TRAILER
from tlm_model import ModelConfig, TransformerLM, save_model_file

CONFIG = ModelConfig(48, 8, 16, 1, 2, 24)


def write_state(path: Path, state: dict) -> None:
    """A ``train_state.pt`` as the format says: torch.save of the payload, then the trailer."""
    payload = {"format": FORMAT, **state}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    path.write_bytes(data + TRAILER + hashlib.sha256(data).hexdigest().encode() + b"\n")


def write_step(folder: Path, model: TransformerLM, step: int, *, sharded: bool = False) -> Path:
    """A step folder of ``model`` at ``step``: its model file and train state, or DCP shards of its weights."""
    folder.mkdir(parents=True)
    if not sharded:
        save_model_file(model, folder)
        from tlm_model.checkpoint import read_digest

        write_state(folder / "train_state.pt", {"step": step, "model_sha256": read_digest(folder)})
        return folder
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's warning that no process group is set up: one process is meant
        tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
        dcp.save(tensors, storage_writer=FileSystemWriter(folder / "shards"), no_dist=True)
    files = {}
    for root, _, names in os.walk(folder / "shards"):
        for name in names:
            path = Path(root) / name
            files[path.relative_to(folder / "shards").as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    write_state(folder / "train_state.pt",
                {"step": step, "shard_files": files, "model_config": model.config.to_dict()})  # fmt: skip
    return folder


def model(seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(CONFIG, fused=False)


def lora_step(base: TransformerLM, base_folder: Path) -> tuple[TransformerLM, dict]:
    """``base`` with LoRA adapters on q and v (rank 2, alpha 4) whose B is random (B = 0 would merge to the base
    itself), and the ``lora`` record a train state keeps for them over the base saved in ``base_folder``."""
    from tlm_lora import apply_lora, weights_sha256

    adapted = TransformerLM(base.config, fused=False)
    adapted.load_state_dict(base.state_dict())
    apply_lora(adapted, "q,v", rank=2, alpha=4.0, dropout=0.0)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    lora = {"rank": 2, "alpha": 4.0, "targets": "q,v", "dropout": 0.0,
            "base": {"path": str(base_folder), "sha256": weights_sha256(base.state_dict())}}  # fmt: skip
    return adapted, lora


@pytest.fixture
def writers():
    """The writers above, for the tests (``import`` of a test folder's module does not work in importlib mode)."""
    return SimpleNamespace(CONFIG=CONFIG, model=model, write_state=write_state, write_step=write_step,
                           lora_step=lora_step)  # fmt: skip


@pytest.fixture
def make_run(tmp_path):
    """``make_run(steps=(1, 2))``: a run folder (``train.toml``, ``checkpoints/step_N``), step N seeded N."""

    def make(steps=(1, 2), *, sharded=False):
        run = tmp_path / "run"
        (run / "checkpoints").mkdir(parents=True)
        (run / "train.toml").write_text("")
        for step in steps:
            write_step(run / "checkpoints" / f"step_{step:08d}", model(step), step, sharded=sharded)
        return run

    return make
