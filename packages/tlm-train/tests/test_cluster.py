"""SLURM without SLURM: the distributed world read from srun's variables, and a preemption or time-limit signal
sent to real training processes (one, and two gloo ranks with the signal reaching one of them) that checkpoints,
stops every rank at the same step, asks ``scontrol`` (a stand-in on PATH that records its arguments) to requeue
the job, and resumes bit for bit equal to a run never stopped, with more signals sent during the save."""

import json
import os
import signal
import socket
import stat
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tlm_train import RunDir
from tlm_train.cluster import StopSignals, first_node, job_id, requeued, slurm_world

STEPS = 40
SETTINGS = dict(
    vocab_size=48, batch_size=8, grad_accum=2, steps=STEPS, warmup_steps=3, eval_interval=STEPS, eval_batches=1,
    log_interval=STEPS, checkpoint_interval=3, seed=7, peak_flops=1e9, sample_tokens=0,
    model={"context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64},
)  # fmt: skip
TRAIN = """
import json, sys
from tlm_train import TrainConfig, train
config = TrainConfig(**json.loads(sys.argv[1]))
result = train(config, resume=sys.argv[2] == "resume")
print(json.dumps({"step": result.step, "requeued": result.requeued}))
sys.exit(130 if result.interrupted else 0)
"""
#: What srun puts in each task's environment (job 4242, one node, two tasks), less the rank's own numbers.
SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_NTASKS": "2",
        "SLURM_NODELIST": "node1", "SLURM_STEP_NODELIST": "node1"}  # fmt: skip


# --------------------------------------------------------------------------------------- srun's variables


def test_srun_tasks_get_torchruns_variables_and_a_batch_script_gets_none():
    task = {**SRUN, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
    assert slurm_world(task) == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "24242",
    }  # fmt: skip
    # The batch script itself: SLURM_NTASKS and SLURM_PROCID=0 but no step; it is one process.
    assert slurm_world({"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}) == {}
    assert slurm_world({**task, "SLURM_STEP_NUM_TASKS": "1"}) == {}  # srun -n1: one process, no group
    assert slurm_world({**task, "WORLD_SIZE": "4"}) == {}  # srun torchrun: torchrun's own variables win
    assert slurm_world({**task, "MASTER_PORT": "1234"})["MASTER_PORT"] == "1234"


def test_several_nodes_meet_at_the_first_node_of_the_step(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the node list is read as it is
    task = {**SRUN, "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NODELIST": "gpu[07-08]"}  # fmt: skip
    assert slurm_world(task)["MASTER_ADDR"] == "gpu07"
    assert slurm_world({**task, "SLURM_STEP_NODELIST": "a12,b3"})["MASTER_ADDR"] == "a12"


def test_a_job_arrays_task_is_requeued_by_its_own_id_and_a_restart_is_seen():
    assert job_id({"SLURM_JOB_ID": "7"}) == "7"
    assert job_id({"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "2"}) == "7_2"
    assert job_id({}) is None
    assert requeued({"SLURM_RESTART_COUNT": "1"}) and not requeued({"SLURM_RESTART_COUNT": "0"}) and not requeued({})


def test_usr1_and_usr2_ask_for_a_requeue_term_does_not_and_a_second_ctrl_c_interrupts():
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.requested and not signals.requeue
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.requeue
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: a request like the others
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN  # after a stop: late time-limit warnings are moot
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)


# --------------------------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.tile(np.random.default_rng(0).integers(0, 48, 40), 30).astype(np.uint16))
    return path


@pytest.fixture
def scontrol(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An ``scontrol`` on PATH that appends its arguments to a file: (environment to add, that file)."""
    folder, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    folder.mkdir()
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}, calls


def _settings(tokens: Path, out: Path, **changes) -> str:
    return json.dumps({**SETTINGS, "data": [str(tokens)], "out_dir": str(out), **changes})


def _wait_for_checkpoint(processes, run: Path) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if RunDir(run).checkpoints().steps():
            return
        assert all(p.poll() is None for p in processes), "a training process ended before it could be signalled"
        time.sleep(0.005)
    raise AssertionError(f"no checkpoint appeared in {run}")


def _burst(pid: int) -> None:
    """USR1, SIGTERM at once (the step and the stop's save take longer), then USR1 and USR2 for half a second:
    while the checkpoint is written and after (the run may have ended by then)."""
    os.kill(pid, signal.SIGUSR1)
    os.kill(pid, signal.SIGTERM)
    for k in range(50):
        time.sleep(0.01)
        try:
            os.kill(pid, (signal.SIGUSR1, signal.SIGUSR2)[k % 2])
        except ProcessLookupError:
            return


def _assert_equal_states(run: Path, reference: Path) -> None:
    folders = [RunDir(r).checkpoints().path(STEPS) for r in (run, reference)]
    if (folders[0] / "shards").is_dir():  # the ranks' DCP shards, consolidated by DCP itself
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = []
        for folder in folders:
            dcp_to_torch_save(folder / "shards", folder.parent.parent / "whole.pt")
            whole.append(torch.load(folder.parent.parent / "whole.pt", weights_only=True))
        got, want = whole
        assert got.keys() == want.keys() and any(k.startswith("optimizer.") for k in want)
        for key, value in want.items():
            assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(value)), f"{key} differs"
        return
    got, want = (RunDir(r).checkpoints().load(STEPS).state for r in (run, reference))
    assert got["model"].keys() == want["model"].keys()
    for key, tensor in want["model"].items():
        assert torch.equal(got["model"][key], tensor), f"weights differ at {key}"
    assert want["optimizer"]["state"], "no optimizer state to compare"
    for param, state in want["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][param][name]), torch.as_tensor(value))


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.slow
def test_usr1_checkpoints_requeues_the_job_and_the_resume_is_bit_exact(data, tmp_path, forked, scontrol):
    env, calls = scontrol
    env |= {"SLURM_JOB_ID": "77"}
    reference = forked(TRAIN, _settings(data, tmp_path / "reference"), "fresh")
    assert reference.returncode == 0, reference.stderr[-2000:]
    run = tmp_path / "run"
    process = forked(TRAIN, _settings(data, run), "fresh", wait=False, env=env)
    try:
        _wait_for_checkpoint([process], run)
        _burst(process.pid)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    stopped = json.loads(out.splitlines()[-1])
    assert stopped["requeued"] and 3 <= stopped["step"] < STEPS
    assert RunDir(run).checkpoints().steps()[-1] == stopped["step"]  # the step it stopped at, written whole
    assert calls.read_text().splitlines() == ["requeue 77"]
    done = forked(TRAIN, _settings(data, run), "resume", env=env | {"SLURM_RESTART_COUNT": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    _assert_equal_states(run, tmp_path / "reference")
    assert calls.read_text().splitlines() == ["requeue 77"]  # a run that finishes requeues nothing


@pytest.mark.slow
def test_two_srun_ranks_stop_together_when_one_is_signalled_and_resume_bit_exact(data, tmp_path, forked, scontrol):
    env, calls = scontrol

    def ranks(run: Path, mode: str) -> list:
        port = _free_port()  # each launch its own, as each job gets its own
        return [
            forked(TRAIN, _settings(data, run, distributed="ddp"), mode, wait=False,
                   env={**env, **SRUN, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "MASTER_PORT": port})
            for r in range(2)
        ]  # fmt: skip

    def finish(processes: list) -> list[tuple[int, str, str]]:
        try:
            return [(p.wait(timeout=240), *p.communicate(timeout=60)) for p in processes]
        finally:
            for p in processes:
                p.kill()

    for code, _, err in finish(ranks(tmp_path / "reference", "fresh")):
        assert code == 0, err[-2000:]
    run = tmp_path / "run"
    processes = ranks(run, "fresh")
    _wait_for_checkpoint(processes, run)
    _burst(processes[1].pid)  # rank 1 alone: rank 0 learns it through the agreement
    ended = finish(processes)
    for code, _, err in ended:
        assert code == 130 and "Traceback" not in err, err[-2000:]
    steps = {json.loads(out.splitlines()[-1])["step"] for _, out, _ in ended}
    assert len(steps) == 1 and 3 <= min(steps) < STEPS  # both stopped at one step, before the end
    assert RunDir(run).checkpoints().steps()[-1] == min(steps)
    assert calls.read_text().splitlines() == ["requeue 4242"]  # rank 0 requeued the job, once
    for code, _, err in finish(ranks(run, "resume")):
        assert code == 0, err[-2000:]
    _assert_equal_states(run, tmp_path / "reference")


@pytest.mark.parametrize("nodelist", ["[07-08]", ",a12", ""])
def test_a_node_list_without_a_first_host_name_is_refused_in_one_line(monkeypatch, nodelist):
    # SLURM's hostlist syntax starts with a host name (``gpu[07-08]``, ``a12,b3``): a list that does not, read
    # without scontrol, names the variable and what came instead of failing on a missing match.
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError) as caught:
        first_node({"SLURM_NODELIST": nodelist})
    assert str(caught.value) == f"SLURM_NODELIST {nodelist!r}: not a node list"
