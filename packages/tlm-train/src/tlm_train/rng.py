"""Capture and restore the random states of torch, numpy and Python as checkpoint-safe values.

Everything is a tensor, a number, a string or a dict/list of them, so the state loads with
``torch.load(weights_only=True)``: numpy's and Python's Mersenne-Twister keys become int64 tensors.
"""

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """The global RNG states of torch (CPU and every CUDA device), numpy's legacy ``np.random`` and ``random``."""
    # The legacy global state is the one scripts seed with np.random.seed, so it is what a resume needs.
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # noqa: NPY002
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (CUDA states only where CUDA is available)."""
    expected = {"torch", "numpy", "python"}
    if not isinstance(state, dict) or not expected <= set(state):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state must be a dict from rng_state() with keys {sorted(expected)}, got {got}")
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["bit_generator"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))  # noqa: NPY002
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """Seed every global RNG a run touches (torch on every device, numpy's legacy one, Python's)."""
    torch.manual_seed(seed)  # also seeds every CUDA device
    np.random.seed(seed)  # noqa: NPY002 - the legacy global state is the one scripts rely on
    random.seed(seed)
