"""What every command's --checkpoint reads: a run folder, a step folder, a model file or folder, an HF folder, a
LoRA step folder and a PEFT adapter folder, each to its model and tokenizer, by one dispatch."""

import json
import os
import shutil

import pytest
import torch

from tlm_artifacts import BaseModelError, load_model, load_tokenizer, lora_step, model_config, model_file, resolve
from tlm_model import ModelConfig, TransformerLM, save_model_file

CONFIG = ModelConfig(48, 8, 16, 1, 2, 24)  # conftest's


def _same(a: TransformerLM, b: TransformerLM) -> bool:
    return a.state_dict().keys() == b.state_dict().keys() and all(
        torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items()
    )


def test_each_kind_resolves_to_its_model_and_tokenizer_place(tmp_path, make_run):
    run = make_run()
    assert (resolve(run).kind, resolve(run / "checkpoints").kind) == ("run", "run")
    step = resolve(run / "checkpoints" / "step_00000001")
    assert step.kind == "step" and step.tokenizer_path == run / "tokenizer" and step.run.path == run
    assert model_file(step) == (run / "checkpoints" / "step_00000001", 1)
    assert resolve(run / "checkpoints" / "step_00000001" / "model.safetensors").kind == "model"
    save_model_file(TransformerLM(CONFIG), tmp_path / "loose")
    (tmp_path / "loose" / "tokenizer").mkdir()
    assert resolve(tmp_path / "loose").tokenizer_path == tmp_path / "loose" / "tokenizer"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve(tmp_path / "hf").kind == "hf" and resolve(tmp_path / "hf").tokenizer_path is None


def test_a_sharded_step_gives_its_model_in_one_process_in_its_run_and_copied_out(tmp_path, make_run, writers):
    run = make_run((4,), sharded=True)
    folder = run / "checkpoints" / "step_00000004"
    assert not (folder / "model.safetensors").exists()
    copy = shutil.copytree(folder, tmp_path / "elsewhere" / "step_00000004")
    for path, kind in [(run, "run"), (folder, "step"), (copy, "step")]:
        artifact = resolve(path)
        assert artifact.kind == kind and model_config(artifact) == CONFIG
        loaded, step = load_model(artifact)
        assert step == 4 and _same(loaded, writers.model(4))


def test_a_sharded_step_whose_shard_changed_is_refused_before_dcp_reads_it(make_run):
    run = make_run((4,), sharded=True)
    shard = next((run / "checkpoints" / "step_00000004" / "shards").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="do not match the SHA-256 recorded in train_state.pt"):
        load_model(resolve(run / "checkpoints" / "step_00000004"))


def test_a_run_gives_its_newest_verified_step_and_falls_back_saying_so(make_run, writers):
    run = make_run()
    loaded, step = load_model(resolve(run))
    assert step == 2 and _same(loaded, writers.model(2))
    weights = run / "checkpoints" / "step_00000002" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x20
    weights.write_bytes(bytes(data))
    told = []
    loaded, step = load_model(resolve(run), on_damaged=lambda s, e: told.append((s, type(e).__name__)))
    assert step == 1 and told == [(2, "ValueError")] and _same(loaded, writers.model(1))
    assert model_config(resolve(run)) == CONFIG


def test_a_step_folder_missing_its_train_state_is_not_complete(make_run):
    run = make_run((1,))
    (run / "checkpoints" / "step_00000001" / "train_state.pt").unlink()  # a step folder missing a file
    with pytest.raises(ValueError, match="has no complete checkpoint yet"):
        load_model(resolve(run))


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


def test_a_run_without_a_checkpoint(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="has no complete checkpoint yet"):
        load_model(resolve(tmp_path / "run"))
    assert resolve(tmp_path / "run").run.tokenizer() is None


def test_no_tokenizer_where_the_tokenizer_place_is_missing(tmp_path, make_run):
    # A run, a step and a model folder name a tokenizer folder that need not exist; an HF folder
    # without tokenizer.json names none. Either way there is no tokenizer, and no error.
    run = make_run()
    assert not (run / "tokenizer").exists()
    assert load_tokenizer(resolve(run)) is None
    assert load_tokenizer(resolve(run / "checkpoints" / "step_00000001")) is None
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert load_tokenizer(resolve(tmp_path / "hf")) is None


def test_an_hf_folder_loads_through_from_hf_and_an_unreadable_tokenizer_says_why(tmp_path):
    transformers = pytest.importorskip("transformers", reason="HF transformers writes the reference HF folder")
    hf = transformers.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                  num_attention_heads=2, max_position_embeddings=8)  # fmt: skip
    transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path / "hf")
    loaded, step = load_model(resolve(tmp_path / "hf"))
    assert step is None and loaded.config.d_model == 16 and loaded.config.num_layers == 1
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram"}}))
    from tlm_artifacts import UnreadableTokenizer

    with pytest.raises(UnreadableTokenizer):
        load_tokenizer(resolve(tmp_path / "hf"))


# ---------------------------------------------------------------------------------------------
# Adapters: a LoRA step folder and a PEFT adapter folder open as their base with the adapters merged


def _adapted(base: TransformerLM, seed: int) -> TransformerLM:
    """``base`` with q,v adapters whose B is random (B = 0 would merge to the base itself)."""
    from tlm_lora import apply_lora

    adapted = TransformerLM(base.config, fused=False)
    adapted.load_state_dict(base.state_dict())
    apply_lora(adapted, "q,v", rank=2, alpha=4.0, dropout=0.0)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    return adapted.eval()


def _merged(adapted: TransformerLM) -> dict:
    from tlm_lora import merged_state_dict

    return merged_state_dict(adapted)


def test_a_lora_step_opens_as_its_base_merged_and_refuses_a_changed_base(tmp_path, writers):
    from tlm_artifacts.lora import adapter_bytes, file_sha256
    from tlm_lora import weights_sha256

    base = writers.model(1)
    save_model_file(base, tmp_path / "base")
    adapted = _adapted(base, seed=2)
    adapters = {k: v for k, v in adapted.state_dict().items() if ".lora_" in k}  # keyed as training saves them
    folder = tmp_path / "run" / "checkpoints" / "step_00000003"
    folder.mkdir(parents=True)
    data = adapter_bytes(adapters)
    (folder / "adapter.safetensors").write_bytes(data)
    lora = {"rank": 2, "alpha": 4.0, "targets": "q,v", "dropout": 0.0,
            "base": {"path": str(tmp_path / "base"), "sha256": weights_sha256(base.state_dict())}}  # fmt: skip
    writers.write_state(folder / "train_state.pt", {"step": 3, "lora": lora, "adapter_sha256": file_sha256(data),
                                            "model_config": CONFIG.to_dict()})  # fmt: skip
    for path in (tmp_path / "run", folder):
        artifact = resolve(path)
        assert artifact.kind in ("run", "step") and lora_step(artifact)[0] == folder
        loaded, step = load_model(artifact, dtype=torch.float32)
        assert step == 3
        want = _merged(adapted)
        assert all(torch.allclose(loaded.state_dict()[k], want[k], atol=1e-6) for k in want)
    assert lora_step(resolve(tmp_path / "base")) is None
    save_model_file(writers.model(9), tmp_path / "base")  # another base under the recorded path
    with pytest.raises(BaseModelError, match="not the one its adapters were trained on"):
        load_model(resolve(tmp_path / "run"))


def test_a_peft_adapter_opens_beside_its_base_merged(tmp_path, writers):
    from tlm_artifacts.lora import adapter_bytes, peft_config
    from tlm_lora import lora_state_dict
    from tlm_model.interop import to_hf_lora_state_dict

    base = writers.model(1)
    save_model_file(base, tmp_path / "base")
    adapted = _adapted(base, seed=5)
    (tmp_path / "adapter").mkdir()
    lora = {"rank": 2, "alpha": 4.0, "targets": "q,v", "dropout": 0.0}
    config = peft_config(lora, "../base")  # relative to the adapter folder
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(
        adapter_bytes(to_hf_lora_state_dict(lora_state_dict(adapted), CONFIG))
    )
    artifact = resolve(tmp_path / "adapter")
    assert artifact.kind == "peft" and model_config(artifact) == CONFIG
    loaded, step = load_model(artifact, dtype=torch.float32)
    want = _merged(adapted)
    assert step is None and all(torch.allclose(loaded.state_dict()[k], want[k], atol=1e-6) for k in want)
    config["base_model_name_or_path"] = "../adapter"
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is another PEFT adapter"):
        resolve(tmp_path / "adapter")


def test_read_paths_names_the_base_a_lora_step_or_peft_adapter_reads(tmp_path, writers):
    from tlm_artifacts.inputs import read_paths
    from tlm_artifacts.lora import peft_config

    save_model_file(writers.model(1), tmp_path / "base")
    folder = tmp_path / "run" / "checkpoints" / "step_00000001"
    folder.mkdir(parents=True)
    (tmp_path / "run" / "train.toml").write_text("")
    lora = {"rank": 2, "alpha": 4.0, "targets": "q,v", "dropout": 0.0, "base": {"path": str(tmp_path / "base")}}
    writers.write_state(folder / "train_state.pt", {"step": 1, "lora": lora, "model_config": CONFIG.to_dict()})
    (folder / "adapter.safetensors").write_bytes(b"")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(peft_config(lora, "../run")))
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    assert read_paths(tmp_path / "base") == [tmp_path / "base"]
    assert read_paths(tmp_path / "run") == [tmp_path / "run", tmp_path / "base"]
    assert read_paths(folder) == [folder, tmp_path / "base"]
    assert read_paths(tmp_path / "adapter") == [tmp_path / "adapter", tmp_path / "adapter" / "../run",
                                                tmp_path / "base"]  # fmt: skip
    assert read_paths(tmp_path / "nothing") == [tmp_path / "nothing"]  # not an artifact: its reader says so


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda folder, config: {**config, "r": 10**9}, r"r 1000000000 is more than the base's d_model 16"),
        (lambda folder, config: (folder / "adapter_model.safetensors").write_bytes(
            (folder / "adapter_model.safetensors").read_bytes()[:-7]), "is not a readable safetensors file"),
        (lambda folder, config: (folder / "adapter_model.safetensors").write_bytes(b"\x10" * 64),
         "is not a readable safetensors file"),
        (lambda folder, config: {**config, "r": 3}, "its tensors do not fit the adapter adapter_config.json describes"),
        (lambda folder, config: {**config, "lora_alpha": -1}, r"json: lora_alpha must be a finite number > 0, got -1"),
        (lambda folder, config: {**config, "lora_alpha": float("nan")}, "lora_alpha must be a finite number > 0"),
        (lambda folder, config: {**config, "lora_dropout": 5}, r"lora_dropout must be a finite number in \[0, 1\)"),
        (lambda folder, config: {**config, "lora_dropout": "x"}, r"json: lora_dropout must be a number, got str"),
        (lambda folder, config: {**config, "target_modules": []}, r"json: target_modules is empty"),
    ],
)  # fmt: skip
def test_a_damaged_peft_adapter_is_one_value_error_naming_it(tmp_path, writers, damage, message):
    import time

    from tlm_artifacts.lora import adapter_bytes, peft_config
    from tlm_lora import lora_state_dict
    from tlm_model.interop import to_hf_lora_state_dict

    base = writers.model(1)
    save_model_file(base, tmp_path / "base")
    folder = tmp_path / "adapter"
    folder.mkdir()
    config = peft_config({"rank": 2, "alpha": 4.0, "targets": "q,v", "dropout": 0.0}, "../base")
    (folder / "adapter_model.safetensors").write_bytes(
        adapter_bytes(to_hf_lora_state_dict(lora_state_dict(_adapted(base, seed=5)), CONFIG))
    )
    changed = damage(folder, config)
    (folder / "adapter_config.json").write_text(json.dumps(changed if isinstance(changed, dict) else config))
    start = time.process_time()  # CPU seconds: a busy machine stretches the wall clock, not the work done
    with pytest.raises(ValueError, match=message) as info:
        load_model(resolve(folder))
    assert "\n" not in str(info.value) and str(folder) in str(info.value)
    assert time.process_time() - start < 10  # refused before anything of the rank's size is allocated


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("name", ["train_state.pt", "config.json"])
def test_a_fifo_among_an_artifacts_files_is_one_line_not_a_hang(tmp_path, name):
    import threading

    from tlm_artifacts import Artifact, load_train_state

    os.mkfifo(tmp_path / name)  # no writer: a blocking open would wait for ever
    errors = []

    def read():
        try:
            if name == "train_state.pt":
                load_train_state(tmp_path / name)
            else:
                model_config(Artifact("hf", tmp_path, tmp_path, None))
        except ValueError as err:
            errors.append(str(err))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(10)
    what = "training state" if name == "train_state.pt" else "HF config"
    assert not thread.is_alive()
    assert errors == [f"{what} {tmp_path / name}: a FIFO (named pipe), expected a regular file"]


def test_a_peft_adapter_whose_rank_is_the_base_d_model_loads(tmp_path, writers):
    # A LoRA update of a projection has rank at most its smaller side: r == d_model (16) is the largest that means
    # anything, and is read (only a larger one is refused). The loaded model computes what the adapted one does.
    from tlm_artifacts.lora import adapter_bytes, peft_config
    from tlm_lora import apply_lora, lora_state_dict
    from tlm_model.interop import to_hf_lora_state_dict

    base = writers.model(1)
    save_model_file(base, tmp_path / "base")
    adapted = TransformerLM(CONFIG, fused=False)
    adapted.load_state_dict(base.state_dict())
    apply_lora(adapted, "q,v", rank=CONFIG.d_model, alpha=4.0, dropout=0.0)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    folder = tmp_path / "adapter"
    folder.mkdir()
    config = peft_config({"rank": CONFIG.d_model, "alpha": 4.0, "targets": "q,v", "dropout": 0.0}, "../base")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(
        adapter_bytes(to_hf_lora_state_dict(lora_state_dict(adapted), CONFIG))
    )
    model, _ = load_model(resolve(folder))[:2]
    ids = torch.arange(8)[None]
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), adapted.eval()(ids), rtol=1e-5, atol=1e-5)
