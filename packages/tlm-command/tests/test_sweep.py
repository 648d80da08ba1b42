"""``tlm sweep``: a grid's product and a runs file as ordinary run folders; settings checked before anything runs;
a sweep killed mid-run resumes to the summary and the weights of an uninterrupted one, a divergent run included."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tlm_command.main import main
from tlm_experiments import sweep
from tlm_experiments.compare import TIMING_FIELDS
from tlm_model import load_model_file
from tlm_train import RunDir

# The tiny model on a token file; lr 1e6 without decay or clipping diverges in a few steps.
SETTINGS = {"vocab_size": 32, "batch_size": 4, "eval_batches": 2, "peak_flops": 1e9, "warmup_steps": 0,
            "sample_tokens": 0, "weight_decay": 0, "grad_clip": 0, "eval_interval": 10, "checkpoint_interval": 10,
            "context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64}  # fmt: skip


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.tile(np.random.default_rng(0).integers(0, 32, 50), 40).astype(np.uint16))
    return path


def _argv(out, tokens, steps, *extra):
    sets = [arg for key, value in {**SETTINGS, "steps": steps, "data": tokens}.items()
            for arg in ("--set", f"{key}={value}")]  # fmt: skip
    return ["sweep", "--out-dir", str(out), "--grid", "lr=1e6,1e-3", *sets, *extra]


def _wait_until_free(lock, seconds=60):
    fd = os.open(lock, os.O_RDWR)
    try:
        deadline = time.monotonic() + seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{lock} is still held: a worker outlived its sweep"
                time.sleep(0.01)
    finally:
        os.close(fd)


def _summary(folder):
    runs = json.loads((folder / "summary.json").read_text())["runs"]
    return [{k: v for k, v in run.items() if k not in TIMING_FIELDS} for run in runs]


def _weights(run):
    return load_model_file(RunDir(run).checkpoints().path(RunDir(run).checkpoints().steps()[-1])).state_dict()


@pytest.mark.slow
def test_a_killed_sweep_resumes_to_the_summary_and_weights_of_an_uninterrupted_one(
    tmp_path, tokens, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the same threads (the same float sums) in every process
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # Two runs at once, each in a worker process: the kill of the sweep must end them too.
    argv = _argv(killed, tokens, 100, "--quiet", "--jobs", "2")
    process = subprocess.Popen([sys.executable, "-m", "tlm", *argv], env=env)
    second = killed / "lr=1e-3"

    def wait_for(condition, what) -> None:
        deadline = time.monotonic() + 300
        while not condition():
            assert process.poll() is None and time.monotonic() < deadline, f"the sweep ended before {what}"
            time.sleep(0.01)

    # The two runs race on two cores, so the test orders them: the second is frozen at its first checkpoint
    # (SIGSTOP to the worker that holds its lock), the kill comes once the first is recorded as diverged.
    wait_for(lambda: (second / "checkpoints").is_dir() and RunDir(second).checkpoints().steps(), "a checkpoint")
    os.kill(json.loads((second / ".lock").read_text())["pid"], signal.SIGSTOP)  # recorded before it trained
    wait_for(lambda: sweep.read_manifest(killed)["runs"][0]["status"] == "diverged", "lr=1e6 diverged")
    os.kill(process.pid, signal.SIGKILL)  # mid-run: the second run has a checkpoint and has not ended
    assert process.wait() == -signal.SIGKILL
    _wait_until_free(second / ".lock")  # its worker dies with the sweep (stopped or not): the kernel frees the lock
    assert max(RunDir(second).checkpoints().steps()) < 100  # ... before the run could end on its own
    statuses = [r["status"] for r in sweep.read_manifest(killed)["runs"]]
    assert statuses == ["diverged", "running"] and not (killed / "summary.json").exists()

    capsys.readouterr()
    assert main(["sweep", "--resume", str(killed), "--jobs", "1"]) == 0  # in this process (no lock left held)
    log = capsys.readouterr().err
    assert "[lr=1e-3] resumed from step" in log and "[lr=1e6]" not in log  # the finished run is kept as it was
    assert main(_argv(whole, tokens, 100, "--quiet", "--jobs", "1")) == 0  # the uninterrupted twin

    assert _summary(killed) == _summary(whole)
    first, done = _summary(whole)
    assert first["diverged"] and first["status"] == "diverged" and first["final_val_loss"] is None
    assert done["status"] == "done" and done["steps"] == 100 and done["final_val_loss"] < done["best_val_loss"] + 1e-12
    for name, tensor in _weights(whole / "lr=1e-3").items():
        assert torch.equal(tensor, _weights(killed / "lr=1e-3")[name]), name
    # Every run folder is an ordinary one: tlm compare reads the sweep as the summary says.
    assert main(["compare", str(whole), "--json"]) == 0
    compared = json.loads(capsys.readouterr().out)["runs"]
    drop = lambda r: {k: v for k, v in r.items() if k not in (*TIMING_FIELDS, "path")}  # noqa: E731
    assert [drop(r) for r in compared] == [drop(r) for r in _summary(whole)]


def test_a_grid_is_the_product_of_its_keys_and_model_fields_go_to_the_model_table() -> None:
    runs = sweep.expand_grid(["lr=1e-3,3e-3", "d-model=32,64", "norm_eps=1e-6"])
    assert [name for name, _ in runs] == [
        "lr=1e-3,d_model=32,norm_eps=1e-6", "lr=1e-3,d_model=64,norm_eps=1e-6",
        "lr=3e-3,d_model=32,norm_eps=1e-6", "lr=3e-3,d_model=64,norm_eps=1e-6",
    ]  # fmt: skip
    assert runs[1][1] == {"lr": 1e-3, "model.d_model": 64, "model.norm_eps": 1e-6}
    assert sweep.apply({"lr": 0.1, "model": {"num_layers": 2}}, runs[1][1]) == {
        "lr": 1e-3, "model": {"num_layers": 2, "d_model": 64, "norm_eps": 1e-6}
    }  # fmt: skip


def test_a_runs_file_names_its_runs_over_a_shared_base(tmp_path) -> None:
    runs = tmp_path / "runs.toml"
    runs.write_text('[base]\nsteps = 7\n[base.model]\nd_model = 64\n[runs.baseline]\n'
                    '[runs.small-lr]\nlr = 1e-4\n[runs.wide]\nmodel = { d_ff = 256 }\n')  # fmt: skip
    args = sweep.SweepOptions(runs=str(runs), set=["batch_size=8"])
    manifest = sweep.plan(args, tmp_path / "sweep")
    assert [(r["name"], r["settings"]) for r in manifest["runs"]] == [
        ("baseline", {}), ("small-lr", {"lr": 1e-4}), ("wide", {"model.d_ff": 256})
    ]  # fmt: skip
    base = manifest["base"]
    assert (base["steps"], base["batch_size"], base["model"]["d_model"]) == (7, 8, 64)


@pytest.mark.slow  # four short runs and a resume: seconds on a loaded machine
def test_seeds_run_every_setting_n_times_and_the_summary_compares_settings_with_the_baseline(
    tmp_path, tokens, capsys
) -> None:
    out = tmp_path / "sweep"
    sets = [a for k, v in {**SETTINGS, "steps": 6, "eval_interval": 3, "data": tokens, "seed": 5}.items()
            for a in ("--set", f"{k}={v}")]  # fmt: skip
    assert main(["sweep", "--out-dir", str(out), "--grid", "lr=1e-3,3e-3", "--seeds", "2", *sets, "--jobs", "1",
                 "--quiet"]) == 0  # fmt: skip
    manifest = sweep.read_manifest(out)
    assert [(r["name"], r["settings"]) for r in manifest["runs"]] == [
        ("lr=1e-3,seed=5", {"lr": 1e-3, "seed": 5}), ("lr=1e-3,seed=6", {"lr": 1e-3, "seed": 6}),
        ("lr=3e-3,seed=5", {"lr": 3e-3, "seed": 5}), ("lr=3e-3,seed=6", {"lr": 3e-3, "seed": 6}),
    ]  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    base, other = summary["settings"]
    assert summary["baseline"] == "lr=1e-3" and (base["seeds"], other["seeds"]) == ([5, 6], [5, 6])
    finals = {(r["settings"]["lr"], r["seed"]): r["final_val_loss"] for r in summary["runs"]}
    assert base["final_val_loss"]["n"] == 2
    assert base["final_val_loss"]["mean"] == pytest.approx((finals[1e-3, 5] + finals[1e-3, 6]) / 2, rel=1e-12)
    versus = other["vs_baseline"]
    assert versus["method"] == "paired" and versus["n"] == 2  # the same seeds: paired by seed
    assert versus["estimate"] == pytest.approx(
        (finals[3e-3, 5] - finals[1e-3, 5] + finals[3e-3, 6] - finals[1e-3, 6]) / 2, rel=1e-9
    )
    assert "| lr=3e-3 | 5, 6 | 2 done |" in (out / "summary.md").read_text()
    # The summary again, against another baseline: a resume of a finished sweep trains nothing.
    assert main(["sweep", "--resume", str(out), "--baseline", "lr=3e-3", "--jobs", "1", "--quiet"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["baseline"] == "lr=3e-3" and again["runs"] == summary["runs"]
    assert again["settings"][0]["vs_baseline"]["estimate"] == pytest.approx(-versus["estimate"], rel=1e-12)


def test_a_failed_run_is_in_the_summary_with_its_message(tmp_path, capsys) -> None:
    out = tmp_path / "sweep"
    sets = [a for k, v in {**SETTINGS, "steps": 2, "data": tmp_path / "missing.npy"}.items()
            for a in ("--set", f"{k}={v}")]  # fmt: skip
    assert main(["sweep", "--out-dir", str(out), "--grid", "lr=1e-3", *sets, "--jobs", "1", "--quiet"]) == 1
    (run,) = json.loads((out / "summary.json").read_text())["runs"]
    assert run["status"] == "failed" and "missing.npy" in run["message"]
    # It trained nothing; no count in a summary is ever below zero.
    assert run["steps"] == run["tokens"] == 0 and min(run["planned_steps"], run["parameters"]) >= 0
    assert f"| failed: {run['message']} |" in (out / "summary.md").read_text()


def test_seeds_are_given_one_way(tmp_path, fails) -> None:
    fails(["sweep", "--out-dir", str(tmp_path / "s"), "--grid", "seed=1,2", "--seeds", "2"],
          "--seeds N and seed in a grid or a run's settings: give the seeds one way")  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--grid", "lrr=1,2"], "--grid lrr: not a setting; expected a TrainConfig field (data, "),
        (["--grid", "lr=1e-3,-1"], "run lr=-1: lr must be a finite number > 0, got -1"),
        (["--grid", "lr"], "--grid 'lr': expected KEY=VALUE"),
        (["--grid", "lr=1e-3", "--grid", "lr=1e-2"], "--grid lr is given twice"),
        (["--grid", "norm_eps=1e-5", "--set", "steps=zero"], "run norm_eps=1e-5: steps must be an int, got str"),
        ([], "give --grid KEY=V1,V2,... (one or more) or --runs FILE.toml"),
        (["--runs", "/nonexistent/runs.toml"], "--runs /nonexistent/runs.toml: no such file"),
        (["--grid", "d_model=30"], "run d_model=30: model.d_model must be divisible by num_heads"),
    ],
)
def test_settings_are_checked_before_anything_is_written(tmp_path, fails, argv, message) -> None:
    out = tmp_path / "sweep"
    fails(["sweep", "--out-dir", str(out), *argv], message)
    assert not out.exists()


@pytest.mark.parametrize(("text", "words"), [(b"[runs.a\n", "Expected ']'"), (b"\xff = 1\n", "'utf-8' codec")])
def test_a_runs_file_that_is_not_toml_is_one_line(tmp_path, fails, text, words) -> None:
    runs = tmp_path / "runs.toml"
    runs.write_bytes(text)
    fails(
        ["sweep", "--out-dir", str(tmp_path / "sweep"), "--runs", str(runs)],
        f"--runs {runs} is not valid TOML: {words}",
    )


def test_resume_needs_a_sweep_and_a_new_sweep_an_empty_folder(tmp_path, fails) -> None:
    fails(["sweep", "--resume", str(tmp_path)], f"{tmp_path}: not a sweep folder (no sweep.json in it)")
    (tmp_path / "sweep.json").write_bytes(b"{\xff")
    fails(["sweep", "--resume", str(tmp_path)], f"{tmp_path / 'sweep.json'} is not a sweep manifest: 'utf-8' codec")
    (tmp_path / "sweep.json").write_text("{")
    fails(["sweep", "--resume", str(tmp_path)], f"{tmp_path / 'sweep.json'} is not a sweep manifest: Expecting")
    (tmp_path / "sweep.json").unlink()
    (tmp_path / "notes.txt").write_text("mine")
    fails(["sweep", "--out-dir", str(tmp_path), "--grid", "lr=1e-3"], "exists and is not an empty folder")
    fails(["sweep", "--resume", str(tmp_path), "--grid", "lr=1e-3"], "--resume continues a sweep as planned")


# A --jobs worker's link to its sweep (_die_with_parent), in fresh interpreters (no torch): it lives while the
# sweep does, and the kernel kills it once the sweep is gone (Linux's parent-death signal).
_WORKER = (
    "from tlm_experiments.sweep import _die_with_parent; import time; _die_with_parent(); print('armed', flush=True)"
)
_SWEEP = f"""import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", {_WORKER + "; time.sleep(60)"!r}], stdout=subprocess.PIPE, text=True)
print(worker.pid, worker.stdout.readline().strip(), flush=True)
"""  # the sweep exits at once, leaving its worker behind


def test_a_worker_lives_while_its_sweep_does_and_dies_with_it():
    alone = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, timeout=60)
    assert (alone.returncode, alone.stdout) == (0, "armed\n"), alone.stderr
    if not sys.platform.startswith("linux"):
        return  # the parent-death signal is Linux's
    sweep = subprocess.run([sys.executable, "-c", _SWEEP], capture_output=True, text=True, timeout=60)
    pid, state = sweep.stdout.split()
    assert state == "armed"
    stat = Path(f"/proc/{pid}/stat")
    for _ in range(200):  # the kernel sends SIGKILL when the sweep exits; the worker is gone within moments
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":  # killed, not yet reaped by its new parent
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.05)
    os.kill(int(pid), signal.SIGKILL)
    raise AssertionError("the worker outlived its sweep")
