"""from_hf on HF folders written to mislead: paths that leave the folder, lying configs, indexes and
tensor tables, damaged safetensors. Every one is refused with one short line naming the file (and the
key or tensor), before any model of the claimed size is built; docs/reliability.md lists them.

The folders are real ones: transformers' LlamaForCausalLM.save_pretrained of a tiny random model,
then edited the way the hostile case needs.
"""

import json
import os
import shutil
import signal
import struct

import pytest
import torch

from tlm_model.interop import from_hf

transformers = pytest.importorskip("transformers")

# What a file the safetensors library refuses is called, before the library's own words.
LIBRARY = "not a valid safetensors file: Error while deserializing header: "
IDS = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))


def tiny_hf(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A single-file and a sharded export of the same tiny model, and its logits on IDS."""
    root = tmp_path_factory.mktemp("hf")
    model = tiny_hf()
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="3KB")
    with torch.no_grad():
        logits = model(IDS).logits
    return root, logits


@pytest.fixture
def single(saved, tmp_path):
    shutil.copytree(saved[0] / "single", tmp_path / "single" / "model")
    return tmp_path / "single" / "model"


@pytest.fixture
def sharded(saved, tmp_path):
    shutil.copytree(saved[0] / "sharded", tmp_path / "sharded" / "model")
    assert len(list((tmp_path / "sharded" / "model").glob("model-*.safetensors"))) > 2
    return tmp_path / "sharded" / "model"


def refused(folder, error=ValueError, **kwargs) -> str:
    with pytest.raises(error) as info:
        from_hf(folder, **kwargs)
    message = str(info.value)
    assert "\n" not in message and len(message) < len(str(folder)) * 3 + 400, message[:500]
    return message


def index_of(folder) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def write_index(folder, index) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def header_of(path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_safetensors(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def edit_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_the_unedited_folders_load_with_transformers_logits(saved, single, sharded):
    for folder in (single, sharded):
        with torch.no_grad():
            torch.testing.assert_close(from_hf(folder)(IDS), saved[1], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Paths confined to the folder


def move_shard_out(folder) -> tuple[str, object]:
    """Move one shard beside the folder; returns its name and new path (a valid shard, just elsewhere)."""
    shard = sorted(set(index_of(folder)["weight_map"].values()))[0]
    outside = folder.parent / shard
    (folder / shard).rename(outside)
    return shard, outside


@pytest.mark.parametrize("where", ["parent", "absolute", "subfolder"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(sharded, where):
    shard, outside = move_shard_out(sharded)
    if where == "subfolder":
        (sharded / "sub").mkdir()
        outside = outside.rename(sharded / "sub" / shard)
    target = {"parent": f"../{shard}", "absolute": str(outside), "subfolder": f"sub/{shard}"}[where]
    index = index_of(sharded)
    index["weight_map"] = {k: target if v == shard else v for k, v in index["weight_map"].items()}
    write_index(sharded, index)
    message = refused(sharded)
    assert "model.safetensors.index.json: weight_map[" in message
    assert f"must be a file name inside the folder (no path separator, not '..'), got {target[:30]!r}"[:-1] in message


@pytest.mark.parametrize("name", ["shard", "model.safetensors", "config.json"])
def test_a_symlink_leaving_the_folder_is_refused(sharded, single, name):
    folder = single if name != "shard" else sharded
    if name == "shard":
        name, outside = move_shard_out(folder)
    else:
        outside = folder.parent / name
        (folder / name).rename(outside)
    (folder / name).symlink_to(outside)
    message = refused(folder)
    assert f"{folder / name} is a symlink to {outside}, outside the folder; tlm reads only files inside it" in message


def test_symlinks_inside_the_folder_and_into_the_hub_cache_blobs_are_followed(saved, single, tmp_path):
    # A link to another file of the folder is the folder's own file.
    (single / "model.safetensors").rename(single / "weights.bin")
    (single / "model.safetensors").symlink_to("weights.bin")
    with torch.no_grad():
        torch.testing.assert_close(from_hf(single)(IDS), saved[1], rtol=1e-5, atol=1e-5)
    # huggingface_hub's cache: snapshots/<rev>/<name> -> ../../blobs/<hash>, the folder
    # snapshot_download returns; and a link from it to anywhere else is still refused.
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, name in enumerate(["config.json", "model.safetensors"]):
        shutil.copy(saved[0] / "single" / name, repo / "blobs" / f"blob{i}")
        (snapshot / name).symlink_to(f"../../blobs/blob{i}")
    with torch.no_grad():
        torch.testing.assert_close(from_hf(snapshot)(IDS), saved[1], rtol=1e-5, atol=1e-5)
    (repo / "refs").mkdir()
    (repo / "blobs" / "blob1").rename(repo / "refs" / "blob1")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to("../../refs/blob1")
    assert "outside the folder" in refused(snapshot)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(single):
    # Opening a FIFO for reading waits for a writer that never comes: the old loader hung here.
    (single / "model.safetensors").unlink()
    os.mkfifo(single / "model.safetensors")

    def timeout(*args):
        raise TimeoutError("from_hf blocked on a FIFO")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(10)
    try:
        message = refused(single)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert message.endswith("model.safetensors is not a regular file; an HF folder holds files only")


# ---------------------------------------------------------------------------------------------
# Index files


@pytest.mark.parametrize(
    "content, error, message",
    [
        (b"[1, 2]", ValueError, "model.safetensors.index.json must hold a JSON object, got list"),
        (b'{"weight_map": [1]}', ValueError, "weight_map must be a JSON object (tensor name -> shard file), got list"),
        (b"{not json", ValueError, "model.safetensors.index.json is not valid JSON: Expecting property name"),
        (b'{"weight_map": {"model.norm.weight": 7}}', TypeError, "weight_map['model.norm.weight'] must be a file name"),
        (b'{"weight_map": {"model.norm.weight": null}}', TypeError, "must be a file name (a string), got NoneType"),
        (b"[" * 100_000, ValueError, "model.safetensors.index.json is not valid JSON: it nests too deeply"),
        (b" " * (17 << 20), ValueError, "is over 16,777,216 bytes: too large for a config or index file"),
    ],
    ids=["list", "weight-map-list", "not-json", "int-value", "null-value", "deep", "huge"],
)
def test_a_malformed_index_is_one_line_naming_it(sharded, content, error, message):
    (sharded / "model.safetensors.index.json").write_bytes(content)
    text = refused(sharded, error)
    assert str(sharded / "model.safetensors.index.json") in text and message in text


def test_an_index_that_disagrees_with_the_config_is_refused_before_a_shard_is_opened(sharded):
    index = index_of(sharded)
    index["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = index["weight_map"]["model.norm.weight"]
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    write_index(sharded, index)
    for shard in sharded.glob("model-*.safetensors"):
        shard.write_bytes(b"")  # never read: the index alone is enough to refuse
    message = refused(sharded)
    assert message.endswith(
        "model.safetensors.index.json does not fit "
        f"{sharded / 'config.json'}: missing tensors ['model.layers.1.mlp.up_proj.weight']; "
        "tlm has no place for tensors ['model.layers.0.self_attn.q_proj.bias']"
    )


def test_a_shard_holding_tensors_its_index_places_elsewhere_is_refused(sharded):
    index = index_of(sharded)
    shards = sorted(set(index["weight_map"].values()))
    held = {shard: sorted(k for k, v in index["weight_map"].items() if v == shard) for shard in shards}
    source = next(shard for shard in shards if len(held[shard]) > 1)  # so the index still names it
    target = next(shard for shard in shards if shard != source)
    index["weight_map"][held[source][0]] = target
    write_index(sharded, index)
    message = refused(sharded)
    if source < target:  # shards are opened in name order: the first to disagree is named
        assert message == f"{sharded / source} holds tensors its index does not place there: [{held[source][0]!r}]"
    else:
        assert message == (
            f"{sharded / 'model.safetensors.index.json'} places tensors in {target} that it does not hold: "
            f"[{held[source][0]!r}]"
        )


def test_a_single_file_beside_an_index_wins_as_in_transformers(saved, sharded, tmp_path):
    # What a stale export leaves: an old index and shards beside a new model.safetensors. transformers
    # reads the single file; so must tlm (the old loader read the index: the old weights).
    newer = tiny_hf(seed=1)
    newer.save_pretrained(tmp_path / "newer")
    shutil.copy(tmp_path / "newer" / "model.safetensors", sharded / "model.safetensors")
    reference = transformers.AutoModelForCausalLM.from_pretrained(sharded).eval()
    with torch.no_grad():
        expected = reference(IDS).logits
        torch.testing.assert_close(expected, newer(IDS).logits, rtol=0, atol=0)
        torch.testing.assert_close(from_hf(sharded)(IDS), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# config.json values

LLAMA3_NULL = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": None,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
YARN_STR = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": "16"}


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"num_attention_heads": None}, TypeError, "num_attention_heads must be an int, got NoneType (None)"),
        ({"num_attention_heads": 0}, ValueError, "num_attention_heads must be in [1, 4096], got 0"),
        ({"num_key_value_heads": 0}, ValueError, "num_key_value_heads must be in [1, 4096], got 0"),
        ({"hidden_size": "16"}, TypeError, "hidden_size must be an int, got str ('16')"),
        ({"head_dim": 8.0}, TypeError, "head_dim must be an int, got float (8.0)"),
        ({"max_position_embeddings": 1e12}, TypeError, "max_position_embeddings must be an int, got float"),
        ({"max_position_embeddings": 10**12}, ValueError, "max_position_embeddings must be in [1, 1048576], got"),
        ({"num_hidden_layers": 100_000}, ValueError, "num_hidden_layers must be in [1, 1024], got 100000"),
        ({"vocab_size": True}, TypeError, "vocab_size must be an int, got bool (True)"),
        ({"rms_norm_eps": None}, TypeError, "rms_norm_eps must be a number, got NoneType"),
        ({"rms_norm_eps": float("nan")}, ValueError, "rms_norm_eps must be a finite number >= 0, got nan"),
        ({"tie_word_embeddings": 1}, TypeError, "tie_word_embeddings must be a bool, got int (1)"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, ValueError, "rope_theta must be a finite"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "big"}}, TypeError, "rope_theta must be a number"),
        ({"rope_parameters": [1, 2]}, ValueError, "rope_parameters=[1, 2] (expected a dict)"),
        ({"rope_parameters": LLAMA3_NULL}, TypeError, "rope_parameters.low_freq_factor must be a number, got NoneType"),
        ({"rope_parameters": YARN_STR}, TypeError, "original_max_position_embeddings must be an int, got str ('16')"),
        ({"num_attention_heads": 3, "num_key_value_heads": 2}, ValueError, "num_kv_heads must divide num_heads, got"),
        ({f"unknown_{i}": i for i in range(100_000)}, ValueError, "unknown keys ['unknown_0', 'unknown_1', "),
        ({"architectures": ["X" * 10**6]}, ValueError, "architectures must be ['LlamaForCausalLM'], got ['XXXX"),
    ],
    ids=[
        *("null-heads", "zero-heads", "zero-kv-heads", "str-width", "float-head-dim", "float-context"),
        *("huge-context", "100k-layers", "bool-vocab", "null-eps", "nan-eps", "int-tie", "negative-theta"),
        *("str-theta", "rope-list", "llama3-null", "yarn-str", "heads-kv", "100k-unknown-keys", "megabyte-arch"),
    ],
)
def test_a_config_value_of_the_wrong_type_or_size_is_one_line_naming_the_key(single, built, changes, error, message):
    edit_config(single, **changes)
    text = refused(single, error)
    assert text.startswith(str(single / "config.json")) and message in text
    assert built == []  # refused from config.json alone


@pytest.mark.parametrize(
    "content, message",
    [(b"[]", "config.json must hold a JSON object, got list"), (b"{", "config.json is not valid JSON")],
)
def test_a_config_that_is_not_an_object_is_one_line_naming_it(single, content, message):
    (single / "config.json").write_bytes(content)
    assert message in refused(single)


def test_a_missing_config_or_weights_is_a_file_not_found_error_naming_it(single):
    (single / "model.safetensors").unlink()
    assert "no model.safetensors nor model.safetensors.index.json" in refused(single, FileNotFoundError)
    (single / "config.json").unlink()
    assert "it has no config.json" in refused(single, FileNotFoundError)
    assert "not an HF model folder" in refused(single / "nowhere", FileNotFoundError)


# ---------------------------------------------------------------------------------------------
# Tensor tables


def test_a_config_claiming_1024_layers_is_refused_from_one_meta_layer_in_one_line(single, built):
    edit_config(single, num_hidden_layers=1024, max_position_embeddings=2**20, vocab_size=2**24)
    message = refused(single)
    assert "missing tensors ['model.layers.10.input_layernorm.weight', " in message and "] and 9,194 more;" in message
    assert "model.embed_tokens.weight has shape [32, 16], config.json needs [16777216, 16]" in message
    assert built == [(1, {"device": "meta"})]


@pytest.mark.parametrize("dtype", ["I32", "BOOL", "U8", "I64"])
def test_integer_and_bool_weights_are_refused_by_name(single, built, dtype):
    path = single / "model.safetensors"
    header, data = header_of(path)
    # model.norm.weight is 16 float32s (64 bytes): reinterpret it at the same byte size.
    size = {"I32": 4, "BOOL": 1, "U8": 1, "I64": 8}[dtype]
    header["model.norm.weight"].update(dtype=dtype, shape=[64 // size])
    write_safetensors(path, header, data)
    message = refused(single, dtype=torch.float32)  # asking for float32 must not convert integers silently
    if size == 4:
        assert f"model.norm.weight is {dtype}, not a floating dtype (BF16, F16, F32, F64)" in message
    else:
        assert "model.norm.weight has shape" in message
    assert built == [(1, {"device": "meta"})]


def test_an_integer_table_of_the_right_shape_names_every_such_tensor(single, built):
    path = single / "model.safetensors"
    header, data = header_of(path)
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight"):
        header[name]["dtype"] = "I32"
    write_safetensors(path, header, data)
    message = refused(single)
    assert "model.layers.0.input_layernorm.weight is I32, not a floating dtype" in message
    assert "model.norm.weight is I32, not a floating dtype" in message
    assert built == [(1, {"device": "meta"})]


def test_a_tensor_of_another_shape_is_refused_by_name_before_loading(single, built):
    path = single / "model.safetensors"
    header, data = header_of(path)
    header["model.layers.1.mlp.down_proj.weight"]["shape"] = [24, 16]  # (16, 24) transposed: same bytes
    write_safetensors(path, header, data)
    message = refused(single)
    assert message == (
        f"{path} does not fit {single / 'config.json'}: "
        "model.layers.1.mlp.down_proj.weight has shape [24, 16], config.json needs [16, 24]"
    )
    assert built == [(1, {"device": "meta"})]


def test_dtype_must_be_a_floating_dtype(single):
    assert refused(single, TypeError, dtype=torch.int8) == (
        "dtype must be a floating-point torch.dtype or None, got torch.int8"
    )


# ---------------------------------------------------------------------------------------------
# Damaged safetensors


def test_every_truncation_of_a_shard_is_one_line_naming_it(sharded):
    shard = sharded / sorted(set(index_of(sharded)["weight_map"].values()))[1]
    good = shard.read_bytes()
    for length in range(0, len(good), 7):
        shard.write_bytes(good[:length])
        message = refused(sharded)
        assert str(shard) in message and ("truncated" in message or "corrupt" in message), (length, message)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda h, a, b: h[a].update(data_offsets=h[b]["data_offsets"]),
            LIBRARY + "invalid offset for tensor",
        ),  # overlap
        (
            lambda h, a, b: h[a].update(data_offsets=[0, 2**62]),
            LIBRARY + "invalid offset for tensor",
        ),
        (
            lambda h, a, b: h[a].update(data_offsets=[2**40, 2**40 + 64]),
            LIBRARY + "invalid offset for tensor",
        ),
        (
            lambda h, a, b: h[a].update(dtype="F8_E4M3"),
            LIBRARY + "invalid shape, data type, or offset",
        ),  # 1-byte items
        (
            lambda h, a, b: h[a].update(shape=[4, 4, 1, 2]),
            LIBRARY + "invalid shape, data type, or offset",
        ),
        (
            lambda h, a, b: h.update(__metadata__={"format": ["pt"]}),
            LIBRARY + "invalid JSON in header: invalid type",
        ),
    ],
    ids=["overlapping", "offsets-disagree", "out-of-range", "unknown-dtype", "shape-lies", "metadata"],
)
def test_a_lying_header_is_one_line_naming_the_file(single, edit, message):
    path = single / "model.safetensors"
    header, data = header_of(path)
    edit(header, "model.norm.weight", "model.layers.0.input_layernorm.weight")
    write_safetensors(path, header, data)
    text = refused(single)
    assert text.startswith(str(path)) and message in text


def test_a_header_length_beyond_the_file_is_refused_before_reading(single):
    path = single / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + path.read_bytes()[8:])
    assert "is truncated or not a safetensors file: its header claims" in refused(single)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_weights_that_are_not_numbers_are_refused_by_name(tmp_path, value):
    # transformers' from_pretrained loads such a folder and generates from it; tlm names the tensor instead.
    model = tiny_hf()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = value
    model.save_pretrained(tmp_path / "model")
    message = refused(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    assert message == f"{weights}: model.layers.1.mlp.down_proj.weight hold NaN or infinite values"
