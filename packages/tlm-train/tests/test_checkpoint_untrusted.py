"""A training-state file is read with ``torch.load(weights_only=True)``: a pickle in it that would run code is
refused before anything runs, even when the file's SHA-256 trailer is made to match (anyone can compute it)."""

import hashlib
import io
import os

import pytest
import torch

from tlm_artifacts.train_state import FORMAT, load_train_state
from tlm_train.checkpoint import load_checkpoint, read_checkpoint


def _crafted(tmp_path, marker):
    class Payload:
        def __reduce__(self):  # unpickling calls os.mkdir(marker): code that leaves a trace
            return (os.mkdir, (str(marker),))

    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "step": 1, "model": Payload(), "digest": "0" * 64}, buffer)
    body = buffer.getvalue()
    path = tmp_path / "train_state.pt"
    path.write_bytes(body + b"\n#tlm-train-state sha256 " + hashlib.sha256(body).hexdigest().encode() + b"\n")
    return path


def _load_into_a_model(path):
    model = torch.nn.Linear(2, 2)
    return load_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("read", [load_train_state, read_checkpoint, _load_into_a_model])
def test_a_pickle_that_runs_code_is_refused_and_runs_nothing(tmp_path, read):
    marker = tmp_path / "ran"
    path = _crafted(tmp_path, marker)
    refusal = r"train_state.pt is not a readable checkpoint \(truncated or corrupt\?\): Weights only load failed"
    with pytest.raises(ValueError, match=refusal):
        read(path)
    assert not marker.exists()


def test_the_same_pickle_does_run_code_without_weights_only(tmp_path):
    # The control: the crafted file is a working exploit for an unguarded torch.load.
    marker = tmp_path / "ran"
    path = _crafted(tmp_path, marker)
    torch.load(io.BytesIO(path.read_bytes()), weights_only=False)
    assert marker.is_dir()
