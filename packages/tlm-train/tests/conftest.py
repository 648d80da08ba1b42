"""Fixtures for tlm-train's tests: a small token file, fast training settings, folder snapshots, and processes
(fresh interpreters, or forks of a warm one) to kill."""

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

#: A model that trains in well under a second a step on a CPU.
TINY_MODEL = {"context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64}
FAST = {"batch_size": 4, "eval_batches": 2, "peak_flops": 1e9, "warmup_steps": 1, "sample_tokens": 8}


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    """2,000 token ids in [0, 32) as a .npy file (a repeating pattern: a model can learn it)."""
    path = tmp_path / "tokens.npy"
    rng = np.random.default_rng(0)
    np.save(path, np.tile(rng.integers(0, 32, 50), 40).astype(np.uint16))
    return path


@pytest.fixture
def make_config(tmp_path: Path, tokens: Path):
    """``make_config(**settings)``: a TrainConfig of the tiny model on ``tokens`` into ``tmp_path/run``."""
    from tlm_train import TrainConfig

    def make(**settings):
        base = {"out_dir": str(tmp_path / "run"), "data": [str(tokens)], "vocab_size": 32, "steps": 4,
                "model": dict(TINY_MODEL), **FAST}  # fmt: skip
        return TrainConfig(**{**base, **settings})

    return make


@pytest.fixture
def snapshot():
    """``snapshot(folder)``: every file's path, mode and SHA-256 under ``folder`` (to prove nothing changed)."""

    def take(folder: Path) -> dict[str, tuple[int, str]]:
        out = {}
        for root, _, files in os.walk(folder):
            for name in files:
                path = Path(root) / name
                out[str(path.relative_to(folder))] = (
                    path.stat().st_mode,
                    hashlib.sha256(path.read_bytes()).hexdigest(),
                )
        return out

    return take


@pytest.fixture
def python():
    """``python(code, *args, **popen)``: run ``code`` in a fresh interpreter with one thread (a subprocess)."""

    def start(code: str, *args: str, wait: bool = True, **kwargs):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
        command = [sys.executable, "-c", textwrap.dedent(code), *args]
        if wait:
            return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, **kwargs)
        return subprocess.Popen(command, env=env, **kwargs)

    return start


#: What a forked process finds imported: torch, tlm-train, torch._dynamo (which torch.optim's first optimizer
#: imports: seconds), and matplotlib as train's loss plot imports it.
WARM_IMPORTS = """
import torch, torch._dynamo, tlm_model, tlm_optim, tlm_train
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot
except ImportError:
    pass
"""


@pytest.fixture
def forked(fork_server):
    """``forked(code, *args, wait=True)``: like ``python``, but the process is forked from an interpreter that
    has imported torch and tlm-train already (the root conftest's ``fork_server``): a killed or resumed run
    then costs a fork, not an interpreter start. Its stdout and stderr are always captured."""
    return fork_server(WARM_IMPORTS)


class _HostTransfers:
    """Counts the copies between the host and the device while active, both ways.

    Device to host: ``aten::_local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``), a ``_to_copy`` or
    ``copy_`` onto the CPU from another device, and the Python-level reads (``Tensor.item``/``tolist``/
    ``__bool__``/``__float__``/``numpy``..., seen by a ``TorchFunctionMode``: ``tolist`` of a CPU tensor reads
    memory without dispatching). Host to device: ``aten::lift_fresh`` (``torch.tensor``/``as_tensor`` of Python
    data: on an accelerator, that data copied to the device; on the CPU the same call, so a CPU run sees it)
    and a ``_to_copy``/``copy_`` from the CPU onto another device. Factories filled by a kernel (``full``,
    ``zeros``, ``scalar_tensor``) copy nothing and are not counted. One CPU has no second device, so there the
    cross-device copies cannot occur; the same counter under ``TLM_TEST_DEVICE=cuda`` sees them."""

    _PYTHON_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"})

    def __init__(self) -> None:
        self.copies: list[str] = []

    def __enter__(self) -> "list[str]":
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        copies = self.copies
        aten = torch.ops.aten
        moves = {aten._to_copy.default, aten.copy_.default}
        lifts = {aten.lift_fresh.default, aten.lift_fresh_copy.default}

        def device_of(value):  # type: ignore[no-untyped-def]
            return value.device.type if isinstance(value, torch.Tensor) else None

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if func is aten._local_scalar_dense.default:
                    copies.append(f"D2H {func}")
                elif func in lifts:
                    copies.append(f"H2D {func}")
                elif func in moves:
                    source = device_of(args[1] if func is aten.copy_.default else args[0])
                    target = device_of(args[0] if func is aten.copy_.default else out)
                    if source != target and "meta" not in (source, target):
                        copies.append(f"{'D2H' if target == 'cpu' else 'H2D'} {func} {source}->{target}")
                return out

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                name = getattr(func, "__name__", "")
                if name in _HostTransfers._PYTHON_READS:
                    copies.append(f"D2H Tensor.{name}")
                return func(*args, **(kwargs or {}))

        self._modes = (Function(), Dispatch())
        for mode in self._modes:
            mode.__enter__()
        return copies

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


@pytest.fixture
def host_transfers():
    """``with host_transfers() as copies: ...``: ``copies`` lists every host-to-device and device-to-host copy
    made inside the block (``"H2D ..."``/``"D2H ..."``; see :class:`_HostTransfers` for what counts)."""
    return _HostTransfers
