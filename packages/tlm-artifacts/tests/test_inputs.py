"""read_paths (tlm_artifacts.inputs): each base a reading opens is named once, even where the bases recorded in
LoRA steps lead back to where the reading started."""

from tlm_artifacts.inputs import read_paths


def _lora_run(folder, base, writers):
    """A LoRA run folder whose one step records ``base`` as the model its adapters were trained on."""
    step = folder / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    (folder / "train.toml").write_text("")
    lora = {"rank": 2, "alpha": 4.0, "targets": "q,v", "dropout": 0.0, "base": {"path": str(base)}}
    writers.write_state(step / "train_state.pt", {"step": 1, "lora": lora, "model_config": writers.CONFIG.to_dict()})
    (step / "adapter.safetensors").write_bytes(b"")


def test_bases_that_lead_back_to_the_start_are_each_named_once(tmp_path, writers):
    _lora_run(tmp_path / "a", tmp_path / "b", writers)
    _lora_run(tmp_path / "b", tmp_path / "b" / ".." / "a", writers)  # the same folder, spelled otherwise
    assert read_paths(tmp_path / "a") == [tmp_path / "a", tmp_path / "b"]
    assert read_paths(tmp_path / "b") == [tmp_path / "b", tmp_path / "b" / ".." / "a"]
