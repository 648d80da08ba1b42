"""Kill a real training process (SIGKILL at a random step, or Ctrl-C), resume it, and compare with a
run never stopped: bit-identical weights, optimizer state and metrics (timing fields aside)."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tlm_train.metrics import TIMING_FIELDS

pytestmark = pytest.mark.slow

STEPS = 16
FLAGS = [
    "--vocab-size", "48", "--context-length", "16", "--d-model", "32", "--num-layers", "2", "--num-heads", "2",
    "--d-ff", "64", "--batch-size", "8", "--grad-accum", "2", "--steps", str(STEPS), "--warmup-steps", "3",
    "--eval-interval", "4", "--eval-batches", "2", "--checkpoint-interval", "3", "--seed", "7",
    "--peak-flops", "1e9", "--quiet",
]  # fmt: skip


def _env() -> dict[str, str]:
    # One thread in every run: the same reduction order in the uninterrupted and resumed runs.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


def _command(tokens: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tlm_train", "train", "--data", str(tokens), "--out-dir", str(out), *FLAGS, *extra]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.tile(rng.integers(0, 48, 40), 30).astype(np.uint16))
    return path


@pytest.fixture(scope="module")
def reference(tokens: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    subprocess.run(_command(tokens, out), env=_env(), check=True, timeout=300)
    return out


def _final_state(run: Path) -> dict:
    return torch.load(run / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)


def _metrics(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in lines]


def _assert_same_run(run: Path, reference: Path) -> None:
    got, want = _final_state(run), _final_state(reference)
    assert got["model"].keys() == want["model"].keys()
    for key, tensor in want["model"].items():
        assert torch.equal(got["model"][key], tensor), f"weights differ at {key}"
    for param, state in want["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][param][name]), torch.as_tensor(value))
    assert _metrics(run) == _metrics(reference)


def _wait_for_step(process: subprocess.Popen, metrics: Path, step: int) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            if lines and lines[-1].endswith("}") and json.loads(lines[-1])["step"] >= step:
                return
        assert process.poll() is None, "the training process ended before it could be stopped"
        time.sleep(0.005)
    raise AssertionError(f"step {step} never appeared in {metrics}")


def test_sigkill_at_a_random_step_then_resume_is_bit_identical(tokens: Path, reference: Path, tmp_path: Path) -> None:
    kill_at = random.Random(12).randint(4, STEPS - 4)
    out = tmp_path / "run"
    process = subprocess.Popen(_command(tokens, out), env=_env())
    try:
        _wait_for_step(process, out / "metrics.jsonl", kill_at)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    killed_at = max(json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines())
    assert killed_at < STEPS
    subprocess.run(_command(tokens, out, "--resume", str(out)), env=_env(), check=True, timeout=300)
    _assert_same_run(out, reference)


def test_ctrl_c_checkpoints_and_exits_cleanly_then_resumes_exactly(
    tokens: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    process = subprocess.Popen(_command(tokens, out), env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(process, out / "metrics.jsonl", 5)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    steps = sorted(int(p.stem.split("_")[1]) for p in (out / "checkpoints").glob("step_*.pt"))
    last_logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert steps[-1] == last_logged < STEPS  # the checkpoint is of the step it stopped at
    subprocess.run(_command(tokens, out, "--resume", str(out)), env=_env(), check=True, timeout=300)
    _assert_same_run(out, reference)
