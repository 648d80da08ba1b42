"""``tlm sweep --launcher slurm`` refuses each bad cluster input in one line, before any job runs: no SLURM here,
a partition the cluster does not have, a job array that sbatch refuses, a sweep folder the jobs cannot write, a
SLURM flag without the SLURM launcher. ``sinfo`` and ``sbatch`` are stand-ins on PATH (no SLURM needed)."""

import json
import stat
from pathlib import Path

import pytest

pytest.importorskip("submitit", reason="tlm sweep --launcher slurm needs the slurm extra (submitit)")

GRID = ["--grid", "lr=1e-3,3e-3", "--set", "steps=2"]


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch):
    """``cluster(sbatch=SCRIPT)``: stand-in sinfo (partitions debug*, gpu), sbatch and srun on PATH."""

    def make(sbatch: str = 'echo "Submitted batch job 41"') -> Path:
        folder = tmp_path / "bin"
        folder.mkdir(exist_ok=True)
        for name, body in {"sinfo": 'printf "debug*\\ngpu\\n"', "sbatch": sbatch, "srun": "exit 0"}.items():
            (folder / name).write_text(f"#!/bin/sh\n{body}\n")
            (folder / name).chmod(0o755 | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{folder}:/usr/bin:/bin")
        return folder

    return make


def test_no_slurm_here_is_one_line(tmp_path, monkeypatch, fails) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
    fails(["sweep", "--launcher", "slurm", "--out-dir", str(tmp_path / "s"), *GRID],
          "--launcher slurm: no sbatch on PATH, so SLURM is not available here; use --launcher local")  # fmt: skip
    assert not (tmp_path / "s").exists()


def test_an_unknown_partition_is_one_line_naming_the_clusters(tmp_path, cluster, fails) -> None:
    cluster()
    fails(["sweep", "--launcher", "slurm", "--partition", "nope", "--out-dir", str(tmp_path / "s"), *GRID],
          "--partition nope: SLURM has no such partition (it has: debug, gpu)")  # fmt: skip
    assert not (tmp_path / "s").exists()


def test_a_job_array_sbatch_refuses_is_one_line_and_no_run_reads_submitted(tmp_path, cluster, fails) -> None:
    cluster(sbatch='echo "sbatch: error: Batch job submission failed: Requested node configuration is not '
            'available" >&2; exit 1')  # fmt: skip
    fails(["sweep", "--launcher", "slurm", "--gpus", "1", "--out-dir", str(tmp_path / "s"), *GRID],
          "sbatch refused the job array of 2 runs", "Requested node configuration is not available")  # fmt: skip
    manifest = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [e["status"] for e in manifest["runs"]] == ["pending", "pending"]
    assert manifest["launcher"] == {"name": "slurm", "partition": None, "time": 60, "cpus_per_task": 1, "gpus": 1}


def test_a_sweep_folder_the_jobs_cannot_write_is_one_line(tmp_path, cluster, fails) -> None:
    cluster()
    fails(["sweep", "--launcher", "slurm", "--out-dir", "/proc/tlm-sweep", *GRID], "/proc/tlm-sweep")


def test_a_slurm_flag_without_the_slurm_launcher_is_one_line(tmp_path, fails) -> None:
    out = str(tmp_path / "s")
    fails(["sweep", "--partition", "gpu", "--out-dir", out, *GRID], "--partition is for --launcher slurm")
