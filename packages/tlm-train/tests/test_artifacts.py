"""What tlm train writes, tlm_artifacts reads back: a run's step folders, one model file or DCP shards (the
resolution of every kind is tlm-artifacts' tests'; these are the round trips through tlm-train's writer)."""

import torch

from tlm_artifacts import load_model, model_config, resolve
from tlm_model import ModelConfig, TransformerLM
from tlm_train import CheckpointManager, capture_state

CONFIG = ModelConfig(48, 8, 16, 1, 2, 24)


def _run(tmp_path, steps=(1, 2)):
    from tlm_optim import AdamW

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "train.toml").write_text("")
    manager = CheckpointManager(run / "checkpoints", keep=5)
    for step in steps:
        torch.manual_seed(step)
        model = TransformerLM(CONFIG, fused=False)
        manager.save(model, capture_state(model, AdamW(model.parameters()), step=step))
    return run, manager


def test_a_sharded_step_gives_its_model_in_one_process_in_its_run_and_copied_out(tmp_path):
    import shutil

    from tlm_optim import AdamW

    run = tmp_path / "run"
    manager = CheckpointManager(run / "checkpoints", keep=5)
    torch.manual_seed(3)
    model = TransformerLM(CONFIG, fused=False)
    state = capture_state(model, AdamW(model.parameters()), step=4)
    manager.save(model, {**state, "sharded": True})  # as DDP/FSDP2 ranks write it, with one rank here
    copy = shutil.copytree(manager.path(4), tmp_path / "elsewhere" / "step_00000004")
    for path, kind in [(run, "run"), (manager.path(4), "step"), (copy, "step")]:
        artifact = resolve(path)
        assert artifact.kind == kind and model_config(artifact) == CONFIG
        loaded, step = load_model(artifact)
        assert step == 4 and loaded.state_dict().keys() == model.state_dict().keys()
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_run_gives_its_newest_verified_step_and_falls_back_saying_so(tmp_path):
    run, manager = _run(tmp_path)
    model, step = load_model(resolve(run))
    assert step == 2 and model.config == CONFIG
    weights = manager.path(2) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x20
    weights.write_bytes(bytes(data))
    told = []
    model, step = load_model(resolve(run), on_damaged=lambda s, e: told.append((s, type(e).__name__)))
    assert step == 1 and told == [(2, "ValueError")]
    torch.manual_seed(1)
    assert torch.equal(model.lm_head.weight, TransformerLM(CONFIG, fused=False).lm_head.weight)
    assert model_config(resolve(run)) == CONFIG


def test_the_readers_live_in_tlm_artifacts_only():
    """The re-exports kept for tlm-train 0.3's importers are gone (issue 43): one home per name."""
    import importlib.util

    import tlm_train
    import tlm_train.checkpoint

    assert importlib.util.find_spec("tlm_train.artifacts") is None
    assert importlib.util.find_spec("tlm_train.lora") is None
    assert not {"resolve", "load_model", "load_tokenizer", "Artifact", "load_train_state"} & set(tlm_train.__all__)
    assert not {"load_step_model", "read_model_state", "load_train_state"} & set(tlm_train.checkpoint.__all__)
