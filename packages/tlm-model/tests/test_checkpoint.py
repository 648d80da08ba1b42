import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tlm_model import ModelConfig, TransformerLM, load_checkpoint, save_checkpoint

CFG = ModelConfig(vocab_size=97, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=80, rope_theta=500.0)


def trained_looking(model: TransformerLM) -> TransformerLM:
    # Norm gains away from their initial ones, so a gain that failed to load would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name:
                p.copy_(torch.rand_like(p) + 0.5)
    return model


def tokens(n: int = 12) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, n), generator=torch.Generator().manual_seed(1))


def test_round_trip_gives_bit_identical_logits(tmp_path):
    model = trained_looking(TransformerLM.from_config(CFG))
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == CFG
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert torch.equal(loaded(tokens()), model(tokens()))


def test_build_options_are_not_saved_but_can_be_passed(tmp_path):
    # fused/unfused projections hold the same weights in another layout: the checkpoint loads
    # into either. Bit-identical logits need the same layout; another agrees to float32 rounding.
    model = trained_looking(TransformerLM.from_config(CFG, fused=False))
    save_checkpoint(model, tmp_path)
    assert torch.equal(load_checkpoint(tmp_path, fused=False)(tokens()), model(tokens()))
    torch.testing.assert_close(load_checkpoint(tmp_path, fused=True)(tokens()), model(tokens()), rtol=1e-5, atol=1e-6)


def test_round_trip_keeps_every_tensor_exactly(tmp_path):
    model = trained_looking(TransformerLM.from_config(CFG))
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_round_trip(tmp_path, dtype):
    model = trained_looking(TransformerLM.from_config(CFG)).to(dtype)
    save_checkpoint(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16" if dtype == torch.bfloat16 else "F16"}
    loaded = load_checkpoint(tmp_path)  # dtype defaults to the saved one
    assert all(p.dtype == dtype for p in loaded.parameters())
    assert loaded.rope.cos.dtype == torch.float32
    assert torch.equal(loaded(tokens()), model(tokens()))


def test_dtype_and_device_on_load(tmp_path, device):
    model = trained_looking(TransformerLM.from_config(CFG))
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path, dtype=torch.float64, device=device)
    assert all(p.dtype == torch.float64 and p.device.type == device.type for p in loaded.parameters())
    # Widening is exact, so the float64 model holds the very same weights.
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key].cpu(), value.double()), key


def test_files_are_what_they_claim(tmp_path, course_lm_keys):
    model = TransformerLM.from_config(CFG)
    returned = save_checkpoint(model, tmp_path / "new" / "dir")  # parents are created
    assert returned == tmp_path / "new" / "dir"
    assert sorted(p.name for p in returned.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((returned / "config.json").read_text())
    assert config == {"format": 1, **CFG.to_dict()}
    with safe_open(str(returned / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == course_lm_keys(CFG.num_layers)
        for key in f.keys():
            assert f.get_slice(key).get_shape() == list(model.state_dict()[key].shape), key
    # Any safetensors reader gets the course's state dict, loadable without tlm's loader.
    plain = TransformerLM.from_config(CFG)
    plain.load_state_dict(load_file(str(returned / "model.safetensors")))
    assert torch.equal(plain(tokens()), model(tokens()))


def test_saves_from_a_compiled_model_under_plain_keys(tmp_path, course_lm_keys):
    model = trained_looking(TransformerLM.from_config(CFG))
    save_checkpoint(torch.compile(model), tmp_path)  # wrapping alone; nothing is compiled
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == course_lm_keys(CFG.num_layers)


def test_tensors_sharing_storage_are_saved(tmp_path):
    # Tied embeddings are the usual case: one tensor under two names. safetensors refuses shared
    # storage, so save_checkpoint must clone; the reload must still tie nothing and match.
    model = TransformerLM.from_config(CFG)
    with torch.no_grad():
        model.lm_head.weight = model.token_embeddings.weight
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert torch.equal(loaded.lm_head.weight, model.token_embeddings.weight)
    assert torch.equal(loaded(tokens()), model(tokens()))


def test_saving_leaves_the_model_untouched(tmp_path):
    model = trained_looking(TransformerLM.from_config(CFG))
    before = {k: (v.clone(), v._version) for k, v in model.state_dict().items()}
    save_checkpoint(model, tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key][0]) and value._version == before[key][1], key


def test_overwrites_an_existing_checkpoint(tmp_path):
    save_checkpoint(TransformerLM.from_config(CFG), tmp_path)
    second = trained_looking(TransformerLM.from_config(CFG))
    save_checkpoint(second, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_checkpoint(tmp_path)(tokens()), second(tokens()))


def test_matching_config_is_accepted(tmp_path):
    save_checkpoint(TransformerLM.from_config(CFG), tmp_path)
    assert load_checkpoint(tmp_path, config=ModelConfig(**CFG.to_dict())).config == CFG


def test_mismatched_config_names_every_differing_field(tmp_path):
    save_checkpoint(TransformerLM.from_config(CFG), tmp_path)
    requested = ModelConfig(**{**CFG.to_dict(), "d_model": 64, "d_ff": 160, "rope_theta": 10_000.0})
    expected = (
        "checkpoint config mismatch: d_model is 32 in the checkpoint but 64 requested; "
        "d_ff is 80 in the checkpoint but 160 requested; "
        "rope_theta is 500.0 in the checkpoint but 10000.0 requested"
    )
    with pytest.raises(ValueError) as info:
        load_checkpoint(tmp_path, config=requested)
    assert str(info.value) == expected


def test_config_must_be_a_model_config(tmp_path):
    save_checkpoint(TransformerLM.from_config(CFG), tmp_path)
    with pytest.raises(TypeError, match="config must be a ModelConfig or None, got dict"):
        load_checkpoint(tmp_path, config=CFG.to_dict())


def test_save_rejects_what_is_not_a_transformer_lm(tmp_path):
    with pytest.raises(TypeError, match="model must be a TransformerLM, got Linear"):
        save_checkpoint(torch.nn.Linear(2, 2), tmp_path)


def test_save_rejects_a_model_on_the_meta_device(tmp_path):
    with pytest.raises(ValueError, match="is on the meta device"):
        save_checkpoint(TransformerLM.from_config(CFG, device="meta"), tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_missing_file_names_the_path(tmp_path, missing):
    save_checkpoint(TransformerLM.from_config(CFG), tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_checkpoint(tmp_path)
    assert info.value.filename == str(tmp_path / missing)
    assert str(tmp_path / missing) in str(info.value) and "not a tlm checkpoint" in str(info.value)


def test_missing_directory_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path / "nowhere")


def corrupt(tmp_path, name: str, content: str | bytes) -> None:
    save_checkpoint(TransformerLM.from_config(CFG), tmp_path)
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "config.json is not valid JSON: Expecting property name"),
        ("[1, 2]", "config.json must hold a JSON object, got list"),
        (json.dumps(CFG.to_dict()), 'config.json has no "format" field, so save_checkpoint did not write it'),
        (json.dumps({"format": 2, **CFG.to_dict()}), 'has "format": 2; this tlm-model reads checkpoint format 1'),
        (json.dumps({"format": 1, **CFG.to_dict(), "dropout": 0.1}), "config.json: unknown ModelConfig fields"),
        (json.dumps({"format": 1, **CFG.to_dict(), "d_model": 30}), "must be divisible by num_heads"),
    ],
    ids=["not-json", "not-an-object", "no-format", "future-format", "unknown-field", "invalid-config"],
)
def test_malformed_config_is_a_value_error_naming_the_file(tmp_path, content, message):
    corrupt(tmp_path, "config.json", content)
    with pytest.raises(ValueError) as info:
        load_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value) and message in str(info.value)


def test_wrongly_typed_config_field_is_a_type_error(tmp_path):
    corrupt(tmp_path, "config.json", json.dumps({"format": 1, **CFG.to_dict(), "d_model": "32"}))
    with pytest.raises(TypeError, match="ModelConfig.d_model must be an int, got str"):
        load_checkpoint(tmp_path)


def test_corrupt_weights_are_a_value_error_naming_the_file(tmp_path):
    corrupt(tmp_path, "model.safetensors", b"\x00" * 7)
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_checkpoint(tmp_path)


def test_weights_that_do_not_fit_the_config_are_torchs_runtime_error(tmp_path):
    save_checkpoint(TransformerLM.from_config(CFG), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["lm_head.weight"] = torch.zeros(5, CFG.d_model)
    del state["layers.1.ln2.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(RuntimeError) as info:
        load_checkpoint(tmp_path)
    message = str(info.value)
    assert 'Missing key(s) in state_dict: "layers.1.ln2.weight"' in message
    assert "size mismatch for lm_head.weight: copying a param with shape torch.Size([5, 32])" in message


def test_mixed_dtypes_need_an_explicit_dtype(tmp_path):
    model = TransformerLM.from_config(CFG)
    model.lm_head.to(torch.bfloat16)
    save_checkpoint(model, tmp_path)
    with pytest.raises(ValueError, match=r"several dtypes \['torch.bfloat16', 'torch.float32'\]; pass dtype="):
        load_checkpoint(tmp_path)
    assert load_checkpoint(tmp_path, dtype=torch.float32).lm_head.weight.dtype == torch.float32
