"""rng_state / set_rng_state restore torch, numpy and Python draws exactly, through weights_only."""

import io
import random

import numpy as np
import pytest
import torch

from tlm_train import rng_state, set_rng_state


def _draws():
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), np.random.randn(), [random.random() for _ in range(3)]  # noqa: NPY002


def test_round_trip_through_weights_only_load():
    np.random.seed(1)  # noqa: NPY002
    random.seed(1)
    np.random.randn()  # noqa: NPY002 - leaves a cached Gaussian in the state
    state = rng_state()
    expected = _draws()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    torch.manual_seed(123)
    np.random.seed(123)  # noqa: NPY002
    random.seed(123)
    set_rng_state(torch.load(buffer, weights_only=True))
    assert _draws() == expected


def test_bad_state():
    with pytest.raises(ValueError, match="rng_state"):
        set_rng_state({"torch": torch.get_rng_state()})


def test_seed_everything_seeds_torch_numpy_and_python():
    from tlm_train.rng import seed_everything

    seed_everything(1234)
    got = _draws()
    torch.manual_seed(1234)
    np.random.seed(1234)  # noqa: NPY002
    random.seed(1234)
    assert got == _draws()
    seed_everything(1235)
    assert [a != b for a, b in zip(_draws(), got, strict=True)] == [True] * 4


@pytest.mark.parametrize("state", [["torch", "numpy", "python"], "torch numpy python", 3])
def test_a_state_that_is_not_a_dict_is_refused_naming_its_type(state):
    with pytest.raises(ValueError, match=rf"state must be a dict from rng_state\(\) .*got {type(state).__name__}$"):
        set_rng_state(state)


def test_the_cuda_states_are_every_cuda_devices_and_only_where_cuda_is():
    state = rng_state()
    assert ("cuda" in state) == torch.cuda.is_available()
    if torch.cuda.is_available():
        assert all(map(torch.equal, state["cuda"], torch.cuda.get_rng_state_all()))


def test_where_cuda_is_its_states_are_captured_and_restored(monkeypatch):
    # torch.cuda's calls stood in for, so that a machine without CUDA reaches the branch too.
    states, restored = [torch.zeros(16, dtype=torch.uint8)], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    state = rng_state()
    assert state["cuda"] is states
    set_rng_state(state)
    assert restored == [states]
