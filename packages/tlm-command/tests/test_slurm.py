"""Against a real SLURM (``nox -s tests`` and ``nox -s slurm`` start a one-node one on 127.0.0.1, and set
``TLM_SLURM_REQUIRED``, under which a SLURM that does not answer fails these; skipped when none answers otherwise):
docs/slurm.sbatch's 2-rank DDP job requeued mid-run with ``scontrol requeue`` ends bit-exact equal to the same
job never stopped (weights and AdamW state); a job sent SIGUSR1 before its time limit requeues itself, resumes
and finishes; a 4-run sweep as one job array, one task requeued mid-run, that ``tlm compare`` reads and
``tlm sweep --resume`` finds finished."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "docs" / "slurm.sbatch"
STEPS = 150
MODEL = ["--context-length", "16", "--d-model", "32", "--num-layers", "2", "--num-heads", "2", "--d-ff", "64"]
FLAGS = ["--vocab-size", "48", "--batch-size", "8", "--eval-batches", "1", "--sample-tokens", "0",
         "--peak-flops", "1e9", "--checkpoint-interval", "10", "--eval-interval", "50", "--log-interval", "50",
         "--quiet", *MODEL]  # fmt: skip
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _slurm_up() -> bool:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


REQUIRED = os.environ.get("TLM_SLURM_REQUIRED") == "1"
UP = _slurm_up()
if REQUIRED and not UP:
    pytest.fail("TLM_SLURM_REQUIRED is set but no SLURM answers (sinfo fails)", pytrace=False)
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not UP, reason="no SLURM answers here (sinfo): `nox -s slurm` starts one, runs these"),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("slurm")
    np.save(folder / "tokens.npy", np.tile(np.random.default_rng(0).integers(0, 48, 40), 30).astype(np.uint16))
    return folder


def _env() -> dict[str, str]:
    """The jobs' environment (sbatch exports it): this interpreter's ``tlm`` first on PATH, one thread."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}


def _sbatch(
    work: Path, run: str, *options: str, flags: list[str] | None = None, quiet: bool = True, steps: int = STEPS
) -> str:
    base = FLAGS if quiet else [f for f in FLAGS if f != "--quiet"]
    command = ["sbatch", "--parsable", f"--output={work / run}.out", *options, str(SCRIPT),
               "--data", "tokens.npy", "--steps", str(steps), *base, *(flags or [])]  # fmt: skip
    out = subprocess.run(command, cwd=work, env={**_env(), "RUN": run}, capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


def _job(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait_ended(job: str, timeout: float = 400) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _job(job)
        if state["JobState"] in ENDED:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job} still {_job(job)['JobState']} after {timeout} s")


def _wait_checkpoint(work: Path, run: str, job: str, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    folder = work / run / "checkpoints"
    while time.monotonic() < deadline:
        if folder.is_dir() and any(p.name.startswith("step_") for p in folder.iterdir()):
            return
        assert _job(job)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), _job(job)
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint in {folder} after {timeout} s")


def _whole(work: Path, run: str) -> dict[str, torch.Tensor]:
    """The final step's weights and optimizer state, the ranks' DCP shards consolidated by DCP itself."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tlm_train import RunDir

    folder = RunDir(work / run).checkpoints().path(STEPS)
    dcp_to_torch_save(folder / "shards", work / f"{run}.pt")
    return torch.load(work / f"{run}.pt", weights_only=True)


def test_a_two_rank_job_requeued_mid_run_ends_bit_exact_equal_to_one_never_stopped(work: Path) -> None:
    reference = _sbatch(work, "reference")
    job = _sbatch(work, "requeued")  # runs once the reference has finished (the node has 2 CPUs)
    _wait_checkpoint(work, "requeued", job)
    subprocess.run(["scontrol", "requeue", job], check=True)
    assert _wait_ended(reference)["JobState"] == "COMPLETED", (work / "reference.out").read_text()
    state = _wait_ended(job)
    log = (work / "requeued.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", log
    assert "DUE TO JOB REQUEUE" in log and "restart 1" in log  # stopped once, then ran again
    events = [json.loads(line) for line in (work / "requeued" / "metrics.jsonl").read_text().splitlines()]
    assert events[-1]["step"] == STEPS
    got, want = _whole(work, "requeued"), _whole(work, "reference")
    assert got.keys() == want.keys() and any(k.startswith("optimizer.") for k in want)
    for key, value in want.items():
        assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(value)), f"{key} differs"


def _steps(work: Path, run: str) -> list[int]:
    path = work / run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r["step"] for r in map(json.loads, lines) if "train_loss" in r]


def test_a_job_sent_usr1_before_its_time_limit_checkpoints_there_requeues_itself_resumes_and_finishes(
    work: Path,
) -> None:
    # No checkpoint on an interval (> steps): a checkpoint before the last step is the signal's. Enough steps
    # (milliseconds each) that the signal lands mid-run on a loaded machine.
    steps = 1000
    flags = ["--distributed", "none", "--checkpoint-interval", str(10 * steps), "--log-interval", "1"]
    job = _sbatch(work, "usr1", "--ntasks-per-node=1", "--time=5", flags=flags, quiet=False, steps=steps)
    deadline = time.monotonic() + 400
    while len(_steps(work, "usr1")) < 5:  # training
        assert _job(job)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING") and time.monotonic() < deadline
        time.sleep(0.05)
    # SLURM itself delivers the signal to the job's step (srun's task), as --signal=USR1@120 does at 5 min - 120 s.
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    state = _wait_ended(job)
    log = (work / "usr1.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", log
    stopped = re.search(r"stopped at step (\d+): checkpoint", log)
    assert stopped and f"SLURM job {job} requeued" in log and "restart 1" in log, log
    signalled = int(stopped.group(1))
    assert 5 <= signalled < steps, log
    assert log.index("restart 1") > stopped.end() and "--auto-resume" in log[stopped.end() :], log  # resumed after
    from tlm_train import RunDir

    assert RunDir(work / "usr1").checkpoints().steps() == [signalled, steps]  # the signal's, then the last
    # The log reads as one run: every step once, in order (the requeued run continued at signalled + 1).
    assert _steps(work, "usr1") == list(range(1, steps + 1))


def test_a_four_run_sweep_runs_as_one_job_array_one_task_requeued_that_tlm_compare_reads(
    work: Path, monkeypatch, capsys
) -> None:
    settings = ["data=tokens.npy", "vocab_size=48", "steps=60", "batch_size=8", "eval_interval=30",
                "checkpoint_interval=10", "sample_tokens=0", "peak_flops=1e9", "eval_batches=1",
                "model.context_length=16", "model.d_model=32", "model.num_layers=2", "model.num_heads=2",
                "model.d_ff=64"]  # fmt: skip
    command = [sys.executable, "-m", "tlm", "sweep", "--launcher", "slurm", "--time", "10", "--out-dir", "sweep",
               "--grid", "lr=1e-3,3e-3", "--seeds", "2", *(a for s in settings for a in ("--set", s))]  # fmt: skip
    sweep = subprocess.Popen(command, cwd=work, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = work / "sweep" / "lr=1e-3,seed=0"
        deadline = time.monotonic() + 400
        while not ((first / "checkpoints").is_dir() and any((first / "checkpoints").glob("step_*"))):
            assert sweep.poll() is None and time.monotonic() < deadline, "the first run never checkpointed"
            time.sleep(0.1)
        task = json.loads((work / "sweep" / "sweep.json").read_text())["runs"][0]["job"]
        subprocess.run(["scontrol", "requeue", task], check=True)  # mid-run: SIGTERM, checkpoint, run again
        _, err = sweep.communicate(timeout=500)
    finally:
        sweep.kill()
    assert sweep.returncode == 0, err[-3000:]
    assert _job(task)["Restarts"] == "1"
    manifest = json.loads((work / "sweep" / "sweep.json").read_text())
    assert [e["status"] for e in manifest["runs"]] == ["done"] * 4
    arrays = {e["job"].split("_")[0] for e in manifest["runs"]}
    assert len(arrays) == 1 and sorted(e["job"].split("_")[1] for e in manifest["runs"]) == ["0", "1", "2", "3"]
    from tlm_command.main import main

    monkeypatch.chdir(work)  # in this process: an interpreter start less each
    assert main(["compare", "sweep", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert sorted(r["name"] for r in runs) == sorted(e["name"] for e in manifest["runs"])
    assert all(r["status"] == "done" and r["steps"] == 60 for r in runs)
    assert main(["sweep", "--resume", "sweep", "--quiet"]) == 0  # every run finished: nothing submitted again
    assert json.loads((work / "sweep" / "sweep.json").read_text())["runs"] == manifest["runs"]
