"""What every command's --checkpoint reads: a run folder, a step folder, a model file or folder, an HF folder."""

import json

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM, save_model_file
from tlm_train import CheckpointManager, RunDir, capture_state, load_model, load_tokenizer, resolve
from tlm_train.artifacts import model_config

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


def test_each_kind_resolves_to_its_model_and_tokenizer_place(tmp_path):
    run, manager = _run(tmp_path)
    assert (resolve(run).kind, resolve(run / "checkpoints").kind) == ("run", "run")
    step = resolve(manager.path(1))
    assert step.kind == "step" and step.tokenizer_path == run / "tokenizer" and step.run.path == run
    file = resolve(manager.path(1) / "model.safetensors")
    assert file.kind == "model"
    save_model_file(TransformerLM(CONFIG), tmp_path / "loose")
    (tmp_path / "loose" / "tokenizer").mkdir()
    assert resolve(tmp_path / "loose").tokenizer_path == tmp_path / "loose" / "tokenizer"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve(tmp_path / "hf").kind == "hf" and resolve(tmp_path / "hf").tokenizer_path is None


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


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda p: p / "missing", FileNotFoundError, "no such file or folder"),
        (lambda p: (p / "notes.txt").write_text("x") and p / "notes.txt", ValueError, "is not a model file"),
        (lambda p: p, ValueError, "is not a tlm run folder, step folder or model folder"),
    ],
)
def test_anything_else_is_one_clear_line(tmp_path, make, error, message):
    with pytest.raises(error, match=message):
        resolve(make(tmp_path))


def test_a_run_without_a_checkpoint_and_an_hf_folder_as_a_model_file(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="has no complete checkpoint yet"):
        load_model(resolve(tmp_path / "run"))
    assert RunDir(tmp_path / "run").tokenizer() is None


def test_no_tokenizer_where_the_tokenizer_place_is_missing(tmp_path):
    # A run, a step and a model folder name a tokenizer folder that need not exist; an HF folder
    # without tokenizer.json names none. Either way there is no tokenizer, and no error.
    run, manager = _run(tmp_path)
    assert not (run / "tokenizer").exists()
    assert load_tokenizer(resolve(run)) is None
    assert load_tokenizer(resolve(manager.path(1))) is None
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert load_tokenizer(resolve(tmp_path / "hf")) is None


def test_an_hf_folder_loads_through_from_hf_and_an_unreadable_tokenizer_says_why(tmp_path):
    transformers = pytest.importorskip("transformers", reason="HF transformers writes the reference HF folder")
    hf = transformers.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                  num_attention_heads=2, max_position_embeddings=8)  # fmt: skip
    transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path / "hf")
    model, step = load_model(resolve(tmp_path / "hf"))
    assert step is None and model.config.d_model == 16 and model.config.num_layers == 1
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram"}}))
    from tlm_train.artifacts import UnreadableTokenizer

    with pytest.raises(UnreadableTokenizer):
        load_tokenizer(resolve(tmp_path / "hf"))
