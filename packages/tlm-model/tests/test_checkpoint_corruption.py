"""Every way a checkpoint file can be damaged is refused with a ValueError that names the file.

The safetensors library refuses what breaks the format (its message follows ours, "not a valid
safetensors file: ..."); tlm refuses a header too long or too large to read, a stored config that
lies, and a content hash that differs."""

import json
import random
import struct

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM, load_model_file, save_model_file

# What a file the safetensors library refuses is called, before the library's own words.
LIBRARY = "not a valid safetensors file: Error while deserializing header: "
# As small as the config allows, so that every byte can be damaged in turn.
TINY = ModelConfig(vocab_size=7, context_length=4, d_model=4, num_layers=1, num_heads=2, d_ff=4)


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    save_model_file(TransformerLM(TINY), tmp_path)
    path = tmp_path / "model.safetensors"
    return path, path.read_bytes()


@pytest.mark.slow  # one load per byte of the file: ~8 s on a 2-core CPU
def test_a_flipped_bit_anywhere_in_the_file_is_refused(saved):
    # One bit in every byte (which bit is drawn per byte), plus every bit of the header length.
    path, good = saved
    rng = random.Random(0)
    flips = [(i, rng.randrange(8)) for i in range(len(good))] + [(i, b) for i in range(8) for b in range(8)]
    accepted = []
    for index, bit in flips:
        damaged = bytearray(good)
        damaged[index] ^= 1 << bit
        path.write_bytes(bytes(damaged))
        try:
            load_model_file(path.parent)
        except ValueError as err:
            assert str(path) in str(err), (index, bit, str(err))
        else:
            accepted.append((index, bit))
    assert accepted == [], f"{len(accepted)} of {len(flips)} bit flips loaded"
    assert len(flips) == len(good) + 64


def test_every_truncation_is_refused(saved):
    path, good = saved
    for length in range(len(good)):
        path.write_bytes(good[:length])
        with pytest.raises(ValueError) as info:
            load_model_file(path.parent)
        assert str(path) in str(info.value) and ("truncated" in str(info.value) or "corrupt" in str(info.value))


def test_appended_bytes_are_refused(saved):
    path, good = saved
    path.write_bytes(good + b"\x00")
    with pytest.raises(ValueError, match="not a valid safetensors file: .*incomplete metadata, file not fully covered"):
        load_model_file(path.parent)


def header_of(good: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", good[:8])
    return json.loads(good[8 : 8 + n]), good[8 + n :]


def rewrite(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def swap_names(header: dict) -> None:
    # Two gains of the same shape trade places: the file stays valid, only the hash can tell.
    header["ln_final.weight"], header["layers.0.ln1.weight"] = header["layers.0.ln1.weight"], header["ln_final.weight"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda h: h["lm_head.weight"].update(dtype="F17"),
            LIBRARY + "invalid JSON in header: unknown variant `F17`",
        ),
        (
            lambda h: h["lm_head.weight"].update(shape=[7, -4]),
            LIBRARY + "invalid JSON in header: invalid value: integer `-4`",
        ),
        (
            lambda h: h["lm_head.weight"].update(shape=[7, 5]),
            LIBRARY + "invalid shape, data type, or offset for tensor",
        ),
        (
            lambda h: h.update(__metadata__={"format": 1}),
            LIBRARY + "invalid JSON in header: invalid type: integer `1`, expected a string",
        ),
        (lambda h: h["__metadata__"].update(tlm_format="3"), "has tlm_format '3'; this tlm-model reads format 2"),
        (lambda h: h["__metadata__"].pop("tlm_sha256"), "is corrupt: its metadata lacks ['tlm_sha256']"),
        (lambda h: h["__metadata__"].update(tlm_config="{"), "is not valid JSON"),
        (lambda h: h["__metadata__"].update(tlm_config="{}"), "ModelConfig"),
        (lambda h: h["__metadata__"].update(tlm_config="[1, 2]"), "must hold a JSON object, got list"),
        (lambda h: h["__metadata__"].update(tlm_sha256="0" * 64), "is corrupt: its content hash is"),
        (
            lambda h: h["lm_head.weight"].update(dtype="I32"),
            "lm_head.weight is I32, not a floating dtype (BF16, F16, F32, F64)",
        ),
        (swap_names, "is corrupt: its content hash is"),
    ],
    ids=[
        *("dtype", "negative-dim", "shape-vs-offsets", "metadata", "format", "no-hash"),
        *("config-json", "config-empty", "config-list", "wrong-hash", "int-dtype", "swapped-names"),
    ],
)
def test_a_damaged_header_is_refused_naming_the_file(saved, edit, message):
    path, good = saved
    header, data = header_of(good)
    edit(header)
    rewrite(path, header, data)
    with pytest.raises((ValueError, TypeError)) as info:
        load_model_file(path.parent)
    assert str(path) in str(info.value) and message in str(info.value), str(info.value)


def test_a_hole_between_tensors_is_refused(saved):
    path, good = saved
    header, data = header_of(good)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 4, end + 4]
    rewrite(path, header, data + bytes(4))
    with pytest.raises(ValueError, match=f"not a valid safetensors file: .*invalid offset for tensor `{last}`"):
        load_model_file(path.parent)


def test_a_header_length_beyond_the_file_is_refused_before_reading(saved):
    path, good = saved
    path.write_bytes(struct.pack("<Q", 2**63) + good[8:])
    with pytest.raises(ValueError, match="is truncated or not a safetensors file: its header claims"):
        load_model_file(path.parent)


def refused(path) -> str:
    """The one-line ValueError that loading ``path``'s folder gives (and that it names the file)."""
    with pytest.raises(ValueError) as info:
        load_model_file(path.parent)
    message = str(info.value)
    assert str(path) in message and "\n" not in message, message[:300]
    return message


def test_a_header_listing_more_tensors_than_any_model_is_refused_while_parsing(saved):
    # 65,537 zero-byte tensors tile zero bytes of data, so offsets alone cannot refuse them; parsing stops at the
    # 65,537th entry instead of building them all and listing them in the error.
    path, good = saved
    header, data = header_of(good)
    own = len(header) - 1  # less __metadata__
    header.update({f"junk.{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(2**16 + 1 - own)})
    rewrite(path, header, data)
    assert refused(path).endswith("is not a model tlm can read: its header lists more than 65,536 tensors")


def test_a_file_with_exactly_the_most_tensors_allowed_loads(saved, monkeypatch):
    # The limit lowered to the tiny model's own tensor count (parsing 65,536 entries takes seconds): a file of
    # exactly that many loads, one more is refused; the metadata and the header itself are not tensors.
    from tlm_model import _weights

    path, good = saved
    header, data = header_of(good)
    monkeypatch.setattr(_weights, "MAX_TENSORS", len(header) - 1)
    load_model_file(path.parent)
    header["junk"] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    rewrite(path, header, data)
    assert refused(path).endswith(f"its header lists more than {len(header) - 2:,} tensors")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h.update({"x" * 10**6: {"dtype": "F17"}}), "unknown variant `F17`"),
        # 2⁴⁰ to the 20,000th power is an 800,000-bit number: the library's size check overflows early.
        (lambda h: h["lm_head.weight"].update(shape=[2**40] * 20_000), "overflow computing buffer size"),
        (lambda h: h["__metadata__"].update(tlm_format="9" * 10**6), "has tlm_format '99999"),
    ],
    ids=["megabyte-name", "20k-huge-dims", "megabyte-format"],
)
def test_huge_values_in_a_header_make_a_short_message(saved, edit, message):
    path, good = saved
    header, data = header_of(good)
    edit(header)
    rewrite(path, header, data)
    text = refused(path)
    assert message in text and len(text) < len(str(path)) + 300, text[:400]


@pytest.mark.parametrize(
    ("blob", "words"),
    [
        (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "is not valid JSON: it nests too deeply"),
        (b'{"a": 1', "is not valid JSON: Expecting ',' delimiter"),
        (b'{"\xff": 1}', "is not valid JSON: 'utf-8' codec can't decode byte 0xff"),
        (b"[1, 2]", "must hold a JSON object, got list"),
    ],
    ids=["nested-too-deeply", "cut-short", "not-utf-8", "a-list"],
)
def test_a_header_that_is_not_a_json_object_is_refused(saved, blob, words):
    path = saved[0]
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    assert f"is corrupt: its safetensors header {words}" in refused(path)


def test_a_valid_file_claiming_300000_layers_is_refused_before_anything_is_built(saved, monkeypatch):
    # The file is consistent (its hash matches), only the config it carries is absurd: ModelConfig's
    # limits refuse it before a single module is built, let alone 300,000 layers' worth on the meta device.
    import tlm_model.checkpoint as checkpoint

    path, good = saved
    header, data = header_of(good)
    header["__metadata__"]["tlm_config"] = json.dumps({**TINY.to_dict(), "num_layers": 300_000})
    header["__metadata__"]["tlm_sha256"] = checkpoint._digest(header, [data])
    rewrite(path, header, data)
    built = []
    monkeypatch.setattr(TransformerLM, "__init__", lambda self, *a, **k: built.append(k))
    message = refused(path)
    assert message.endswith("ModelConfig.num_layers must be <= 1,024 (tlm's limit), got 300,000") and built == []


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"context_length": 1e12}, TypeError, "ModelConfig.context_length must be an int, got float (1000000000000.0)"),
        (
            {"context_length": 10**12},
            ValueError,
            "context_length must be <= 1,048,576 (tlm's limit), got 1,000,000,000,000",
        ),
        ({"num_heads": None}, TypeError, "ModelConfig.num_heads must be an int, got NoneType (None)"),
        ({"num_heads": 0}, ValueError, "ModelConfig.num_heads must be positive, got 0"),
        ({"d_model": "x" * 10**6}, TypeError, "ModelConfig.d_model must be an int, got str ('xxxxxxxx"),
        ({f"field_{i}": 0 for i in range(10**5)}, ValueError, "unknown ModelConfig fields ['field_0', 'field_1', "),
    ],
    ids=["float-context", "huge-context", "null-heads", "zero-heads", "megabyte-width", "100k-fields"],
)
def test_a_stored_config_of_the_wrong_type_or_size_is_one_short_line(saved, monkeypatch, changes, error, message):
    # A consistent file (valid hash) whose stored config lies: refused from the config alone.
    import tlm_model.checkpoint as checkpoint

    path, good = saved
    header, data = header_of(good)
    header["__metadata__"]["tlm_config"] = json.dumps({**TINY.to_dict(), **changes})
    header["__metadata__"]["tlm_sha256"] = checkpoint._digest(header, [data])
    rewrite(path, header, data)
    built = []
    monkeypatch.setattr(TransformerLM, "__init__", lambda self, *a, **k: built.append(k))
    with pytest.raises(error) as info:
        load_model_file(path.parent)
    text = str(info.value)
    assert text.startswith(f"{path}: ") and message in text and len(text) < len(str(path)) + 400, text[:500]
    assert built == []
