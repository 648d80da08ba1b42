"""Resume: kill a real training process (SIGKILL at a random step, or Ctrl-C), resume it and compare with a
run never stopped (bit-identical weights, optimizer state and metrics); changed settings applied from the
resumed step on or refused before anything is written; damaged checkpoints never trained on."""

import json
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tlm_train import ResumeError, RunDir, RunInUseError, TrainConfig, train
from tlm_train.metrics import TIMING_FIELDS

STEPS = 16
SETTINGS = dict(
    vocab_size=48, batch_size=8, grad_accum=2, steps=STEPS, warmup_steps=3, eval_interval=4, eval_batches=2,
    checkpoint_interval=3, seed=7, peak_flops=1e9, sample_tokens=0,
    model={"context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64},
)  # fmt: skip
TRAIN = """
import json, sys
from tlm_train import TrainConfig, train
config = TrainConfig(**json.loads(sys.argv[1]))
result = train(config, resume=sys.argv[2] == "resume")
sys.exit(130 if result.interrupted else 0)
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.tile(np.random.default_rng(0).integers(0, 48, 40), 30).astype(np.uint16))
    return path


def _settings(tokens: Path, out: Path, /, **changes) -> dict:
    return {**SETTINGS, "data": [str(tokens)], "out_dir": str(out)} | changes


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    train(TrainConfig(**_settings(data, out)))
    return out


def _final(run: Path) -> dict:
    return RunDir(run).checkpoints().load(STEPS).state


def _metrics(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in lines]


def _assert_same_run(run: Path, reference: Path) -> None:
    got, want = _final(run), _final(reference)
    assert got["model"].keys() == want["model"].keys()
    for key, tensor in want["model"].items():
        assert torch.equal(got["model"][key], tensor), f"weights differ at {key}"
    for param, state in want["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][param][name]), torch.as_tensor(value))
    assert [m for m in _metrics(run) if "event" not in m] == _metrics(reference)


def _wait_for_step(process, metrics: Path, step: int) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            if lines and lines[-1].endswith("}") and json.loads(lines[-1])["step"] >= step:
                return
        assert process.poll() is None, "the training process ended before it could be stopped"
        time.sleep(0.005)
    raise AssertionError(f"step {step} never appeared in {metrics}")


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_is_bit_identical(data, reference, tmp_path, forked) -> None:
    kill_at = random.Random(12).randint(4, STEPS - 4)
    out = tmp_path / "run"
    process = forked(TRAIN, json.dumps(_settings(data, out)), "fresh", wait=False)
    try:
        _wait_for_step(process, out / "metrics.jsonl", kill_at)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    done = forked(TRAIN, json.dumps(_settings(data, out)), "resume")  # a process that never saw the run
    assert done.returncode == 0, done.stderr[-2000:]
    _assert_same_run(out, reference)
    assert all(not name.startswith(".") or name == ".lock" for name in __import__("os").listdir(out / "checkpoints"))


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_exits_cleanly_then_resumes_exactly(data, reference, tmp_path, forked) -> None:
    out = tmp_path / "run"
    process = forked(TRAIN, json.dumps(_settings(data, out)), "fresh", wait=False)
    try:
        _wait_for_step(process, out / "metrics.jsonl", 5)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    steps = RunDir(out).checkpoints().steps()
    last_logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert steps[-1] == last_logged < STEPS  # the checkpoint is of the step it stopped at
    assert train(TrainConfig(**_settings(data, out)), resume=True).step == STEPS
    _assert_same_run(out, reference)


def test_changed_settings_apply_from_the_resumed_step_and_train_toml_says_so(data, tmp_path) -> None:
    out = tmp_path / "run"
    train(TrainConfig(**_settings(data, out, steps=6, checkpoint_interval=3, lr=1e-3)))
    # "Extend this run to 12 steps with a new floor and peak": the schedule continues from step 6.
    extended = TrainConfig(**_settings(data, out, steps=12, checkpoint_interval=3, lr=2e-3, min_lr=5e-4, beta2=0.9))
    lines = []
    train(extended, resume=True, log=lines.append)
    from tlm_optim import cosine_lr

    lrs = {r["step"]: r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in r}
    for step in range(7, 13):  # the rate step s used is the schedule's at s - 1
        assert lrs[step] == pytest.approx(cosine_lr(step - 1, 2e-3, 5e-4, 3, 12))
    assert TrainConfig.from_toml(out / "train.toml").replace(model={}) == extended.replace(model={})
    assert any("--lr 0.002 (was 0.001)" in line and "--steps 12 (was 6)" in line for line in lines)
    state = RunDir(out).checkpoints().load(12).state
    assert state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.9)  # the new beta2, not the saved one
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    events = [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records if "event" in r]
    assert events == [
        {"step": 6, "event": "resume", "changed": {"lr": 2e-3, "min_lr": 5e-4, "beta2": 0.9, "steps": 12}}
    ]


def test_lr_alone_on_resume_rederives_the_floor(data, tmp_path) -> None:
    out = tmp_path / "run"
    train(TrainConfig(**_settings(data, out, steps=4, checkpoint_interval=2)))
    resumed = RunDir(out).read_config(lr=3e-3, steps=6)
    assert resumed.min_lr is None and resumed.final_min_lr == pytest.approx(3e-4)
    assert train(resumed, resume=True).step == 6


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        ({"model": {**SETTINGS["model"], "d_model": 64}}, "--d-model 64 differs from the run's 32"),
        ({"vocab_size": 64}, "--vocab-size 64 differs"),
        ({"seed": 8}, "--seed 8 differs"),
        ({"decay_norms": True}, "--decay-norms True differs"),
        ({"data": ["other.npy"]}, r"--data \['other.npy'\] differs"),
    ],
)
def test_a_change_the_run_cannot_honour_is_refused_before_anything_is_written(data, tmp_path, snapshot, change, flag):
    out = tmp_path / "run"
    train(TrainConfig(**_settings(data, out, steps=3)))
    before = snapshot(out)
    with pytest.raises(ResumeError, match=flag):
        train(TrainConfig(**_settings(data, out, steps=6, **change)), resume=True)
    assert snapshot(out) == before


def test_every_checkpoint_damaged_stops_resume_with_nothing_written(data, tmp_path, snapshot) -> None:
    out = tmp_path / "run"
    train(TrainConfig(**_settings(data, out, steps=6, checkpoint_interval=3, keep_checkpoints=5)))
    for step in (3, 6):
        path = RunDir(out).checkpoints().path(step) / "model.safetensors"
        damaged = bytearray(path.read_bytes())
        damaged[-7] ^= 0x01  # one bit of one weight
        path.write_bytes(bytes(damaged))
    before = snapshot(out)
    with pytest.raises(ResumeError, match="every checkpoint .* is damaged; none can be read back"):
        train(TrainConfig(**_settings(data, out, steps=9)), resume=True)
    assert snapshot(out) == before


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_and_is_replaced(data, reference, tmp_path) -> None:
    out = tmp_path / "run"
    train(TrainConfig(**_settings(data, out, keep_checkpoints=10)))
    manager = RunDir(out).checkpoints(keep=10)
    state = manager.path(STEPS) / "train_state.pt"
    state.write_bytes(state.read_bytes()[:-100])  # a truncated newest checkpoint
    for step in manager.steps():
        if 12 < step < STEPS:
            __import__("shutil").rmtree(manager.path(step))
    said = []
    result = train(TrainConfig(**_settings(data, out, keep_checkpoints=10)), resume=True, log=said.append)
    assert result.step == STEPS
    assert any(f"checkpoint of step {STEPS} is damaged" in line for line in said)
    assert any("resumed from step 12" in line for line in said)
    _assert_same_run(out, reference)  # the damaged step was trained again and replaced, bit-identically


def test_resume_from_a_chosen_step_abandons_the_later_ones(data, reference, tmp_path) -> None:
    out = tmp_path / "run"
    train(TrainConfig(**_settings(data, out, keep_checkpoints=10)))
    assert train(TrainConfig(**_settings(data, out, keep_checkpoints=10)), resume_from=9).step == STEPS
    _assert_same_run(out, reference)


@pytest.mark.slow  # a child process to hold the lock
def test_a_second_run_into_the_same_folder_is_refused_and_a_dead_ones_lock_is_not_stale(data, tmp_path, forked):
    out = tmp_path / "run"
    holder = forked(
        "import sys, time\nfrom tlm_train import RunDir\nwith RunDir(sys.argv[1]).lock() as lock:\n"
        "    lock.record(); print('held', flush=True); time.sleep(60)",
        str(out), wait=False,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunInUseError, match=rf"in use by another tlm train \(pid {holder.pid} on "):
            train(TrainConfig(**_settings(data, out, steps=2)))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert train(TrainConfig(**_settings(data, out, steps=2))).step == 2  # the kernel freed the dead one's lock


def test_a_fine_tune_resumes_against_its_own_shape_not_the_init_models_present_one(tmp_path, make_config):
    """Without a context extension in ``model``, a resumed fine-tune compares its settings with the shape it
    recorded; the ``--init-from`` model is not read again for its shape (here it was replaced since by one of
    another context length, which must not matter to the checkpointed run)."""
    import dataclasses

    from tlm_model import ModelConfig, TransformerLM, save_model_file

    shape = ModelConfig(vocab_size=32, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64)
    save_model_file(TransformerLM(shape), tmp_path / "base")
    config = make_config(init_from=str(tmp_path / "base"), model={}, steps=2, checkpoint_interval=1)
    train(config)
    save_model_file(TransformerLM(dataclasses.replace(shape, context_length=32)), tmp_path / "base")
    result = train(config.replace(steps=3), resume=True)
    assert result.step == 3
