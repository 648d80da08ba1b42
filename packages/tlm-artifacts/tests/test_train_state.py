"""The training state's reader (tlm-train writes the file; the tests here write it from the format's description)."""

import hashlib
import io
import pickle
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from tlm_artifacts.train_state import FORMAT, TRAILER, check_loadable, load_train_state


def _file(payload: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    return data + TRAILER + hashlib.sha256(data).hexdigest().encode() + b"\n"


def test_a_state_reads_back_and_any_flipped_byte_or_cut_is_refused(tmp_path, writers):
    state = {"step": 7, "weights": torch.arange(6.0).reshape(2, 3), "rng": [1, (2, "x")], "none": None}
    path = tmp_path / "train_state.pt"
    writers.write_state(path, state)
    got = load_train_state(path)
    assert got.keys() == state.keys() and torch.equal(got["weights"], state["weights"])
    assert got["rng"] == [1, (2, "x")] and got["step"] == 7 and got["none"] is None
    assert load_train_state(io.BytesIO(path.read_bytes()))["step"] == 7  # a file object too
    data = path.read_bytes()
    for where in (0, len(data) // 3, len(data) // 2, len(data) - 70):  # zip header, body, trailer
        broken = bytearray(data)
        broken[where] ^= 0x01
        path.write_bytes(bytes(broken))
        with pytest.raises(ValueError, match="corrupt|not a tlm-train-state/2 file"):
            load_train_state(path)
    path.write_bytes(data[:-10])
    with pytest.raises(ValueError, match="no SHA-256 trailer"):
        load_train_state(path)


def test_a_whole_file_with_another_format_is_refused_and_format_1_is_read(tmp_path, writers):
    path = tmp_path / "train_state.pt"
    path.write_bytes(_file({"format": "something/1", "digest": "0", "step": 1}))  # trailer right, format not
    with pytest.raises(ValueError, match=f"is not a {FORMAT} file .found format 'something/1'."):
        load_train_state(path)
    path.write_bytes(_file({"step": 1}))  # no format tag at all
    with pytest.raises(ValueError, match=f"is not a {FORMAT} file .found format None."):
        load_train_state(path)
    # tlm-train 0.3 wrote format 1, which also held a SHA-256 of its contents: the trailer's alone now verifies it.
    path.write_bytes(_file({"format": "tlm-train-state/1", "digest": "0" * 64, "step": 3, "w": torch.ones(2)}))
    assert set(got := load_train_state(path)) == {"step", "w"} and got["step"] == 3
    with pytest.raises(TypeError, match="src must be a path or a binary file object, got int"):
        load_train_state(3)


def test_read_sharded_tensors_names_a_step_folder_that_holds_no_shards(tmp_path, writers):
    from tlm_artifacts.steps import read_sharded_tensors

    folder = writers.write_step(tmp_path / "step_00000001", writers.model(1), 1)
    with pytest.raises(FileNotFoundError, match="records no shards"):
        read_sharded_tensors(folder)


LOADABLE = [None, True, 3, 2.5, "x", b"\x00\x01", torch.bfloat16, torch.device("cpu"), torch.arange(3),
             {"a": [1, (2.0, None)], 7: {"b": torch.float32}}]  # fmt: skip


@pytest.mark.parametrize("value", LOADABLE, ids=lambda v: type(v).__name__)
def test_what_check_loadable_passes_loads_back_with_weights_only(value):
    check_loadable(value)
    check_loadable({"nested": [value]})
    buffer = io.BytesIO()
    torch.save({"value": value}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["value"]  # the reference: torch's own safe loader
    assert torch.equal(loaded, value) if isinstance(value, torch.Tensor) else loaded == value


@pytest.mark.parametrize("value", [Path("x"), Fraction(1, 3), Decimal("1.5")], ids=lambda v: type(v).__name__)
def test_what_weights_only_cannot_load_is_refused_naming_where_it_is(value):
    buffer = io.BytesIO()
    torch.save({"value": value}, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):  # the reference: torch's safe loader refuses it too
        torch.load(buffer, weights_only=True)
    with pytest.raises(TypeError, match=rf"^checkpoint\['a'\]\[1\] is a {type(value).__name__}, which torch.load"):
        check_loadable({"a": [1, value]})
