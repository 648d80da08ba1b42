"""save_hf replaces an HF folder as one unit, leaves a user's files alone, and takes extra files
(tokenizer, generation config) into the same unit; transformers reads what it writes."""

import json
import os

import pytest
import torch
from fault_processes import build

from tlm_model import ModelConfig, TransformerLM, save_hf
from tlm_model.interop import from_hf, hf_generation_config

transformers = pytest.importorskip("transformers")

CFG = ModelConfig(vocab_size=32, context_length=32, d_model=16, num_layers=2, num_heads=2, d_ff=24, num_kv_heads=1)
IDS = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))


def model(seed: int) -> TransformerLM:
    return build(seed, CFG)  # norm gains away from 1, so a config beside the wrong weights shows


def files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def assert_holds(folder, expected: TransformerLM) -> None:
    """The folder loads, in tlm and in transformers, as ``expected``, bit for bit."""
    loaded = from_hf(folder).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in expected.state_dict().items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, expected(IDS), rtol=1e-5, atol=1e-5)


def test_an_export_over_an_older_sharded_export_leaves_nothing_of_it(tmp_path):
    # transformers' sharded save of another model: index, shards, generation_config.json. The old
    # save_hf wrote model.safetensors + config.json beside them, and tlm then read the stale index.
    old = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32,
    }))  # fmt: skip
    old.save_pretrained(tmp_path / "out", max_shard_size="3KB")
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    new = model(1)
    assert save_hf(new, tmp_path / "out") == tmp_path / "out"
    assert sorted(files(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left
    assert_holds(tmp_path / "out", new)


def test_extra_files_and_the_generation_config_join_the_export_and_transformers_reads_them(tmp_path):
    payload = hf_generation_config([5, 7], bos_token_id=1, pad_token_id=0)
    assert payload == {"eos_token_id": [5, 7], "bos_token_id": 1, "pad_token_id": 0}
    extra = {"generation_config.json": json.dumps(payload).encode(), "tokenizer_config.json": b'{"x": 1}'}
    m = model(2)
    save_hf(m, tmp_path / "out", extra_files=extra)
    assert files(tmp_path / "out") == {**extra, **files(tmp_path / "out")} and len(files(tmp_path / "out")) == 4
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert (generation.eos_token_id, generation.bos_token_id, generation.pad_token_id) == ([5, 7], 1, 0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert hf.generation_config.eos_token_id == [5, 7]
    assert_holds(tmp_path / "out", m)
    # Exporting again with the same extra files replaces them; without them they are gone.
    save_hf(model(3), tmp_path / "out", extra_files=extra)
    save_hf(model(3), tmp_path / "out")
    assert sorted(files(tmp_path / "out")) == ["config.json", "model.safetensors"]


def test_a_single_eos_id_is_one_int_as_transformers_writes_it():
    assert hf_generation_config(2) == {"eos_token_id": 2}


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((-1,), {}, ValueError, "eos_token_id must be >= 0, got -1"),
        ((True,), {}, TypeError, "eos_token_id must be an int, got bool (True)"),
        (([],), {}, ValueError, "eos_token_id must be a token id or a non-empty list of them, got []"),
        (([1, "2"],), {}, TypeError, "eos_token_id[1] must be an int, got str ('2')"),
        ((1,), {"bos_token_id": 1.0}, TypeError, "bos_token_id must be an int, got float (1.0)"),
        ((1,), {"pad_token_id": -3}, ValueError, "pad_token_id must be >= 0, got -3"),
    ],
)
def test_hf_generation_config_refuses_what_is_not_a_token_id(args, kwargs, error, message):
    with pytest.raises(error) as info:
        hf_generation_config(*args, **kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "content",
    [
        {"notes.txt": b"mine"},
        {"README.md": b"# my model card"},
        {".gitattributes": b"*.bin lfs"},
        {"model.safetensors": b"x", "train.py": b"print()"},
    ],
    ids=["notes", "readme", "gitattributes", "mixed"],
)
def test_a_folder_holding_anything_an_export_does_not_is_left_alone(tmp_path, content):
    out = tmp_path / "out"
    out.mkdir()
    for name, data in content.items():
        (out / name).write_bytes(data)
    foreign = sorted(n for n in content if n != "model.safetensors")
    with pytest.raises(ValueError) as info:
        save_hf(model(0), out)
    assert str(info.value) == (
        f"directory {out} holds {foreign}, which an HF model export does not; save_hf replaces the whole folder, "
        "so it leaves this one alone (save into a new or empty folder)"
    )
    assert files(out) == content and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_subfolder_a_symlink_inside_or_a_symlinked_folder_is_left_alone(tmp_path):
    out = tmp_path / "out"
    save_hf(model(0), out)
    (out / "checkpoints").mkdir()
    with pytest.raises(ValueError, match=r"holds \['checkpoints'\], which an HF model export does not"):
        save_hf(model(1), out)
    (out / "checkpoints").rmdir()
    (tmp_path / "elsewhere.json").write_text("{}")
    (out / "tokenizer.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ValueError, match=r"holds \['tokenizer.json'\], which an HF model export does not"):
        save_hf(model(1), out)
    (out / "tokenizer.json").unlink()
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(ValueError, match=r"directory must be a folder, got a symlink \(.*link\); save_hf replaces"):
        save_hf(model(1), tmp_path / "link")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="directory must be a folder"):
        save_hf(model(1), tmp_path / "file")
    assert_holds(out, model(0))


def test_the_current_folder_or_one_above_it_is_not_replaced(tmp_path, monkeypatch):
    # Swapping the folder a process works in would leave it inside a deleted folder.
    save_hf(model(0), tmp_path / "out")
    monkeypatch.chdir(tmp_path / "out")
    for directory in (".", "", "..", tmp_path):
        with pytest.raises(ValueError, match="directory must not be the current folder or one above it, got "):
            save_hf(model(1), directory)
    assert_holds(tmp_path / "out", model(0))


def test_names_an_export_writes_or_tokenizer_files_are_replaced(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    names = ["config.json", "generation_config.json", "model.safetensors.index.json",
             "model-00001-of-00002.safetensors", "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
             "chat_template.jinja"]  # fmt: skip
    for name in names:
        (out / name).write_bytes(b"old")
    save_hf(model(0), out, extra_files={"custom.txt": b"new"})
    save_hf(model(0), out, extra_files={"custom.txt": b"newer"})  # a name this call writes may be replaced
    assert sorted(files(out)) == ["config.json", "custom.txt", "model.safetensors"]


@pytest.mark.parametrize(
    "extra, error, message",
    [
        ({"sub/tokenizer.json": b""}, ValueError, "extra_files key must be a file name inside the folder"),
        ({"../tokenizer.json": b""}, ValueError, "no path separator, not '..'), got '../tokenizer.json'"),
        ({"..": b""}, ValueError, "got '..'"),
        ({"": b""}, ValueError, "got ''"),
        ({"a\\b": b""}, ValueError, "got 'a\\\\b'"),
        ({7: b""}, TypeError, "extra_files key must be a file name (a string), got int (7)"),
        (
            {"config.json": b"{}"},
            ValueError,
            "must not be a file save_hf writes or HF reads as weights, got 'config.json'",
        ),
        ({"Model.safetensors": b""}, ValueError, "got 'Model.safetensors'"),
        ({"model.safetensors.index.json": b"{}"}, ValueError, "got 'model.safetensors.index.json'"),
        ({"model-00001-of-00002.safetensors": b""}, ValueError, "got 'model-00001-of-00002.safetensors'"),
        ({"pytorch_model.bin": b""}, ValueError, "got 'pytorch_model.bin'"),
        ({"tokenizer.json": "{}"}, TypeError, "extra_files['tokenizer.json'] must be bytes, got str (encode text)"),
        (
            {"generation_config.json": b"[1]"},
            ValueError,
            "extra_files['generation_config.json'] must hold a JSON object",
        ),
        ({"generation_config.json": b"{"}, ValueError, "extra_files['generation_config.json'] is not valid JSON"),
        (
            {"generation_config.json": b'{"eos_token_id": [3, 32]}'},
            ValueError,
            "extra_files['generation_config.json'] eos_token_id[1] must be in [0, 31], got 32",
        ),
        (
            {"generation_config.json": b'{"bos_token_id": "1"}'},
            TypeError,
            "extra_files['generation_config.json'] bos_token_id must be an int, got str",
        ),
    ],
)
def test_bad_extra_files_are_refused_before_anything_is_written(tmp_path, extra, error, message):
    with pytest.raises(error) as info:
        save_hf(model(0), tmp_path / "out", extra_files=extra)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_extra_files_must_be_a_mapping(tmp_path):
    with pytest.raises(TypeError, match="extra_files must be a mapping of file names to bytes, got list"):
        save_hf(model(0), tmp_path / "out", extra_files=[("tokenizer.json", b"{}")])


def test_a_failed_export_leaves_the_previous_one_and_no_temporary_folder(tmp_path, monkeypatch):
    import tlm_model.interop as interop

    old = model(0)
    save_hf(old, tmp_path / "out")
    before = files(tmp_path / "out")

    def fail(step):
        if step == "config-written":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(interop, "_after_step", fail)
    with pytest.raises(OSError, match="No space left on device"):
        save_hf(model(1), tmp_path / "out")
    assert files(tmp_path / "out") == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_the_export_honours_the_umask(tmp_path):
    previous = os.umask(0o027)
    try:
        save_hf(model(0), tmp_path / "out", extra_files={"tokenizer.json": b"{}"})
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750
    assert {(p.stat().st_mode & 0o777) for p in (tmp_path / "out").iterdir()} == {0o640}
