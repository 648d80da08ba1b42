import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tlm_model import ModelConfig, TransformerLM, compile_for_inference, load_model_file, save_model_file

DATA = Path(__file__).parent / "data"
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


def raw_header(path) -> tuple[dict, int]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), n


def definition_digest(header: dict, data: bytes) -> str:
    """The content hash from its definition: SHA-256 of the header without the hash (sorted keys, no
    spaces) followed by every byte after the header."""
    meta = {k: v for k, v in header["__metadata__"].items() if k != "tlm_sha256"}
    canonical = json.dumps({**header, "__metadata__": meta}, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical + data).hexdigest()


def store_config(path, config: dict) -> None:
    """Rewrite the model file at ``path`` to carry ``config``, with a hash that matches: a consistent
    file whose config lies, which only the checks of the config itself can refuse."""
    header, n = raw_header(path)
    data = path.read_bytes()[8 + n :]
    header["__metadata__"]["tlm_config"] = json.dumps(config)
    header["__metadata__"]["tlm_sha256"] = definition_digest(header, data)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_round_trip_gives_bit_identical_logits(tmp_path):
    model = trained_looking(TransformerLM(CFG))
    save_model_file(model, tmp_path)
    loaded = load_model_file(tmp_path)
    assert loaded.config == CFG
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert torch.equal(loaded(tokens()), model(tokens()))


def test_build_options_are_not_saved_but_can_be_passed(tmp_path):
    # fused/unfused projections hold the same weights in another layout: the checkpoint loads
    # into either. Bit-identical logits need the same layout; another agrees to float32 rounding.
    model = trained_looking(TransformerLM(CFG, fused=False))
    save_model_file(model, tmp_path)
    assert torch.equal(load_model_file(tmp_path, fused=False)(tokens()), model(tokens()))
    torch.testing.assert_close(load_model_file(tmp_path, fused=True)(tokens()), model(tokens()), rtol=1e-5, atol=1e-6)


def test_round_trip_keeps_every_tensor_exactly(tmp_path):
    model = trained_looking(TransformerLM(CFG))
    save_model_file(model, tmp_path)
    loaded = load_model_file(tmp_path).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_round_trip(tmp_path, dtype):
    model = trained_looking(TransformerLM(CFG)).to(dtype)
    save_model_file(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16" if dtype == torch.bfloat16 else "F16"}
    loaded = load_model_file(tmp_path)  # dtype defaults to the saved one
    assert all(p.dtype == dtype for p in loaded.parameters())
    assert loaded.rope.cos.dtype == torch.float32
    assert torch.equal(loaded(tokens()), model(tokens()))


def test_dtype_and_device_on_load(tmp_path, device):
    model = trained_looking(TransformerLM(CFG))
    save_model_file(model, tmp_path)
    loaded = load_model_file(tmp_path, dtype=torch.float64, device=device)
    assert all(p.dtype == torch.float64 and p.device.type == device.type for p in loaded.parameters())
    # Widening is exact, so the float64 model holds the very same weights.
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key].cpu(), value.double()), key


def test_the_file_is_a_safetensors_file_holding_weights_config_and_hash(tmp_path, course_lm_keys):
    model = trained_looking(TransformerLM(CFG))
    returned = save_model_file(model, tmp_path / "new" / "dir")  # parents are created
    assert returned == tmp_path / "new" / "dir"
    assert [p.name for p in returned.iterdir()] == ["model.safetensors"]  # one file: nothing to pair up
    path = returned / "model.safetensors"
    # The safetensors library itself (an independent reader) sees the course's keys and shapes ...
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == course_lm_keys(CFG.num_layers)
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["tlm_format"] == "2"
    assert json.loads(meta["tlm_config"]) == CFG.to_dict()
    # ... and the same tensors, loadable without tlm's loader.
    plain = load_file(str(path))
    for key, value in model.state_dict().items():
        assert torch.equal(plain[key], value), key
    # The hash, re-derived from its definition.
    header, n = raw_header(path)
    assert header["__metadata__"]["tlm_sha256"] == definition_digest(header, path.read_bytes()[8 + n :])


def test_a_file_written_by_tlm_model_0_3_0_loads(tmp_path):
    # Written by tlm-model 0.3.0's own safetensors writer (TINY, norm gains drawn in [0.5, 1.5)); the
    # library reads it, and its hash, of the same definition, is checked: a flipped bit is refused.
    fixture = DATA / "tlm-model-0.3.0.safetensors"
    tiny = ModelConfig(vocab_size=7, context_length=4, d_model=4, num_layers=1, num_heads=2, d_ff=4)
    loaded = load_model_file(fixture)
    assert loaded.config == tiny
    plain = load_file(str(fixture))
    assert plain.keys() == loaded.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in plain.items())
    damaged = bytearray(fixture.read_bytes())
    damaged[-1] ^= 1
    (tmp_path / "model.safetensors").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="is corrupt: its content hash is"):
        load_model_file(tmp_path)


def test_saves_to_a_named_file(tmp_path):
    model = trained_looking(TransformerLM(CFG))
    assert save_model_file(model, tmp_path / "step-10.safetensors") == tmp_path / "step-10.safetensors"
    assert [p.name for p in tmp_path.iterdir()] == ["step-10.safetensors"]
    assert torch.equal(load_model_file(tmp_path / "step-10.safetensors")(tokens()), model(tokens()))


def test_saves_from_a_compiled_model_under_plain_keys(tmp_path, course_lm_keys):
    model = trained_looking(TransformerLM(CFG))
    save_model_file(torch.compile(model), tmp_path)  # wrapping alone; nothing is compiled
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == course_lm_keys(CFG.num_layers)
    assert torch.equal(load_model_file(tmp_path)(tokens()), model(tokens()))


def test_saves_a_compile_for_inference_model_like_a_plain_one(tmp_path):
    model = trained_looking(TransformerLM(CFG))
    save_model_file(model, tmp_path / "plain")
    save_model_file(compile_for_inference(model), tmp_path / "inference")  # nothing compiles until a call
    save_model_file(torch.compile(compile_for_inference(model)), tmp_path / "both")
    # The same tensors and metadata (the library orders the metadata's keys differently each time).
    plain = load_file(str(tmp_path / "plain" / "model.safetensors"))
    for name in ("inference", "both"):
        path = str(tmp_path / name / "model.safetensors")
        assert plain.keys() == load_file(path).keys() and all(
            torch.equal(v, load_file(path)[k]) for k, v in plain.items()
        )
        with safe_open(path, "pt") as f, safe_open(str(tmp_path / "plain" / "model.safetensors"), "pt") as g:
            assert f.metadata() == g.metadata()


def test_tensors_sharing_storage_are_saved(tmp_path):
    # Tied embeddings are the usual case: one tensor under two names; the reload must still match.
    model = TransformerLM(CFG)
    with torch.no_grad():
        model.lm_head.weight = model.token_embeddings.weight
    save_model_file(model, tmp_path)
    loaded = load_model_file(tmp_path)
    assert torch.equal(loaded.lm_head.weight, model.token_embeddings.weight)
    assert torch.equal(loaded(tokens()), model(tokens()))


def test_saving_leaves_the_model_untouched(tmp_path):
    model = trained_looking(TransformerLM(CFG))
    before = {k: (v.clone(), v._version) for k, v in model.state_dict().items()}
    save_model_file(model, tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key][0]) and value._version == before[key][1], key


def test_overwrites_an_existing_checkpoint(tmp_path):
    save_model_file(TransformerLM(CFG), tmp_path)
    second = trained_looking(TransformerLM(CFG))
    save_model_file(second, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temporary file left
    assert torch.equal(load_model_file(tmp_path)(tokens()), second(tokens()))


def test_no_symlink_is_followed_on_write(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").symlink_to(outside)
    model = trained_looking(TransformerLM(CFG))
    save_model_file(model, ckpt)
    assert outside.read_bytes() == b"precious"
    assert not (ckpt / "model.safetensors").is_symlink()
    assert torch.equal(load_model_file(ckpt)(tokens()), model(tokens()))


def test_a_failed_save_leaves_the_old_checkpoint_and_no_temporary_file(tmp_path, monkeypatch):
    old = trained_looking(TransformerLM(CFG))
    save_model_file(old, tmp_path)
    import tlm_model.checkpoint as checkpoint

    def fail(step):
        if step == "written":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_after_step", fail)
    with pytest.raises(OSError, match="No space left on device"):
        save_model_file(TransformerLM(CFG), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert torch.equal(load_model_file(tmp_path)(tokens()), old(tokens()))


def test_a_state_dict_file_loads_with_a_config(tmp_path):
    model = trained_looking(TransformerLM(CFG))
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "weights.safetensors"))
    for name in ("weights.pt", "weights.safetensors"):
        assert torch.equal(load_model_file(tmp_path / name, config=CFG)(tokens()), model(tokens())), name


def test_matching_config_is_accepted(tmp_path):
    save_model_file(TransformerLM(CFG), tmp_path)
    assert load_model_file(tmp_path, config=ModelConfig(**CFG.to_dict())).config == CFG


def test_mismatched_config_names_every_differing_field(tmp_path):
    save_model_file(TransformerLM(CFG), tmp_path)
    requested = ModelConfig(**{**CFG.to_dict(), "d_model": 64, "d_ff": 160, "rope_theta": 10_000.0})
    expected = (
        f"checkpoint config mismatch in {tmp_path / 'model.safetensors'}: "
        "d_model is 32 in the checkpoint but 64 requested; "
        "d_ff is 80 in the checkpoint but 160 requested; "
        "rope_theta is 500.0 in the checkpoint but 10000.0 requested"
    )
    with pytest.raises(ValueError) as info:
        load_model_file(tmp_path, config=requested)
    assert str(info.value) == expected


def test_config_must_be_a_model_config(tmp_path):
    save_model_file(TransformerLM(CFG), tmp_path)
    with pytest.raises(TypeError, match="config must be a ModelConfig or None, got dict"):
        load_model_file(tmp_path, config=CFG.to_dict())


def test_save_rejects_what_is_not_a_transformer_lm(tmp_path):
    with pytest.raises(TypeError, match="model must be a TransformerLM \\(or a compiled one\\), got Linear"):
        save_model_file(torch.nn.Linear(2, 2), tmp_path)


def test_save_rejects_a_model_on_the_meta_device(tmp_path):
    with pytest.raises(ValueError, match="is on the meta device"):
        save_model_file(TransformerLM(CFG, device="meta"), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_missing_weights_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_model_file(tmp_path)
    assert info.value.filename == str(tmp_path / "model.safetensors")
    assert "not a tlm checkpoint: missing model.safetensors" in str(info.value)
    for missing in ("nowhere", "nowhere.safetensors"):
        with pytest.raises(FileNotFoundError, match=r"no such checkpoint \(file or folder\)") as info:
            load_model_file(tmp_path / missing)
        assert info.value.filename == str(tmp_path / missing)


def test_a_plain_safetensors_file_needs_a_config(tmp_path):
    save_file(
        {k: v.contiguous() for k, v in TransformerLM(CFG).state_dict().items()}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(
        ValueError, match="model.safetensors is a plain state dict that carries no config; pass config="
    ):
        load_model_file(tmp_path)


def test_weights_that_do_not_fit_the_config_are_refused_naming_the_file(tmp_path):
    model = TransformerLM(CFG)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = torch.zeros(5, CFG.d_model)
    del state["layers.1.ln2.weight"]
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as info:
        load_model_file(tmp_path, config=CFG)
    assert str(info.value) == (
        f"{tmp_path / 'model.safetensors'} does not match config=: "
        "missing tensors ['layers.1.ln2.weight']; unexpected tensors ['extra.weight']; "
        "lm_head.weight has shape [5, 32], the config needs [97, 32]"
    )


def test_absurd_config_sizes_are_refused_before_anything_is_allocated(tmp_path, built):
    # 10¹² × 32 float32 embeddings would be 128 TB: ModelConfig's limits refuse it before any module exists.
    save_model_file(TransformerLM(CFG), tmp_path)
    store_config(tmp_path / "model.safetensors", {**CFG.to_dict(), "vocab_size": 10**12})
    built.clear()
    with pytest.raises(ValueError, match=r"model.safetensors: ModelConfig.vocab_size must be <= 16,777,216"):
        load_model_file(tmp_path)
    assert built == []


def test_the_largest_config_is_checked_from_one_layer_on_the_meta_device(tmp_path, built):
    # Inside every limit, yet 2²⁴ × 2¹⁸ embeddings alone are 16 TiB and 1,024 layers of modules take
    # seconds to build even on the meta device: the names and shapes come from one meta layer, and the
    # error lists a few of the 9,000 missing names, not all of them.
    huge = {**CFG.to_dict(), "vocab_size": 2**24, "d_model": 2**18, "num_layers": 1024, "d_ff": 2**20}
    save_model_file(TransformerLM(CFG), tmp_path)
    store_config(tmp_path / "model.safetensors", huge)
    built.clear()
    with pytest.raises(ValueError) as info:
        load_model_file(tmp_path)
    message = str(info.value)
    # 9 tensors per layer + 3: 9,219 expected, 21 in the file; 4 of the 9,198 missing ones are named.
    assert "missing tensors ['layers.10.attn.k_proj.weight', " in message and "] and 9,194 more;" in message
    assert "layers.0.attn.k_proj.weight has shape [32, 32], the config needs [262144, 262144]" in message
    assert message.endswith("; and 17 more tensors of another shape or dtype")
    assert len(message) < 1000 and "\n" not in message
    assert built == [(1, {"device": "meta"})]  # one layer, on the meta device: nothing allocated


def test_a_consistent_file_whose_config_disagrees_with_its_tensors_is_refused(tmp_path):
    # Written with a valid hash, so only the shape check can catch it.
    save_model_file(TransformerLM(CFG), tmp_path)
    store_config(tmp_path / "model.safetensors", {**CFG.to_dict(), "d_ff": 96})
    with pytest.raises(ValueError, match=r"does not match the config stored in .*ffn.w1.weight has shape \[80, 32\]"):
        load_model_file(tmp_path)


def test_mixed_dtypes_need_an_explicit_dtype(tmp_path):
    model = TransformerLM(CFG)
    model.lm_head.to(torch.bfloat16)
    save_model_file(model, tmp_path)
    with pytest.raises(ValueError, match=r"several dtypes \['torch.bfloat16', 'torch.float32'\]; pass dtype="):
        load_model_file(tmp_path)
    assert load_model_file(tmp_path, dtype=torch.float32).lm_head.weight.dtype == torch.float32


def test_a_plain_state_dict_needs_a_config(tmp_path):
    torch.save(TransformerLM(CFG).state_dict(), tmp_path / "weights.pt")
    with pytest.raises(ValueError, match="weights.pt is a plain state dict that carries no config; pass config="):
        load_model_file(tmp_path / "weights.pt")


@pytest.mark.parametrize("content", [b"", b"garbage", b"PK\x03\x04" + bytes(40)], ids=["empty", "garbage", "zip"])
def test_an_unreadable_torch_file_is_a_value_error_naming_it(tmp_path, content):
    (tmp_path / "weights.pt").write_bytes(content)
    with pytest.raises(ValueError, match="weights.pt is not a readable torch.save file"):
        load_model_file(tmp_path / "weights.pt", config=CFG)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_as_the_model_file_is_refused_without_blocking(tmp_path):
    import threading

    from tlm_model.checkpoint import read_config

    os.mkfifo(tmp_path / "model.safetensors")  # no writer: a blocking open would wait for ever
    os.mkfifo(tmp_path / "model.pt")
    errors = []

    def read(call, path, **options):
        try:
            call(path, **options)
        except ValueError as err:
            errors.append(str(err))

    calls = [(load_model_file, tmp_path, {}), (read_config, tmp_path, {}),
             (load_model_file, tmp_path / "model.pt", {"config": CFG})]  # fmt: skip
    for call, path, options in calls:
        thread = threading.Thread(target=read, args=(call, path), kwargs=options, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), f"{call.__name__} blocked on the FIFO"
    fifo = "a FIFO (named pipe), expected a regular file"
    assert errors == [
        *[f"model file {tmp_path / 'model.safetensors'}: {fifo}"] * 2,
        f"model file {tmp_path / 'model.pt'}: {fifo}",
    ]
