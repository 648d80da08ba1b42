"""``tlm sweep --launcher slurm``: every run of a sweep (each seed too) one task of one SLURM job array,
submitted with submitit (the ``slurm`` extra: ``pip install tlm-experiments[slurm]``).

Each task trains its run as the local launcher does (:func:`tlm_experiments.runs.train_run`: an ordinary
run folder, resumed when it holds one) and records how it ended in ``SWEEP/sweep.json`` itself, under a lock
(``SWEEP/.manifest.lock``), so ``tlm sweep --resume`` and ``tlm compare`` read a SLURM sweep as they read a
local one. A task stopped by SIGUSR2 (submitit asks for it ``signal_delay_s`` before the time limit) or SIGUSR1
checkpoints, requeues itself (``scontrol requeue``) and, when it runs again, continues from that checkpoint;
meanwhile its run reads ``requeued``. The sweep command waits for the array (``squeue``), then writes the
summary; a task that ended without recording an outcome (killed, out of memory) is marked failed with the path
of its log. Job logs go to ``SWEEP/.slurm/``.
"""

import contextlib
import io
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from tlm_core.cli import UserError, say
from tlm_experiments.manifest import manifest_lock

#: Where submitit keeps each task's pickled call and its logs, inside the sweep folder.
LOGS = ".slurm"
#: The statuses a task leaves when its run has ended for good (the others: it was killed, or runs again).
FINAL = ("done", "diverged", "failed", "interrupted")


def check_cluster(partition: str | None) -> None:
    """SLURM is reachable (``sbatch`` on PATH, ``sinfo`` answers) and ``partition``, when given, is one of its
    partitions; each refusal one line."""
    if shutil.which("sbatch") is None:
        raise UserError("--launcher slurm: no sbatch on PATH, so SLURM is not available here; use --launcher local")
    try:
        import submitit  # noqa: F401
    except ImportError:
        raise UserError(
            "--launcher slurm submits with submitit: pip install 'tlm-experiments[slurm]' (or submitit)"
        ) from None
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, check=False, timeout=60)
    if out.returncode != 0:
        reason = (out.stderr or out.stdout).strip().splitlines()
        raise UserError(f"--launcher slurm: sinfo failed ({reason[-1] if reason else out.returncode}): is SLURM up?")
    partitions = [p.rstrip("*") for p in out.stdout.split()]
    if partition is not None and partition not in partitions:
        raise UserError(f"--partition {partition}: SLURM has no such partition (it has: {', '.join(partitions)})")


def check_writable(folder: Path) -> None:
    """The sweep folder takes files (the tasks write their runs and the manifest there)."""
    from tlm_core.atomic import create_new, temp_path

    probe = temp_path(folder / ".write-test")  # a fresh name, created O_EXCL | O_NOFOLLOW: nothing planted is followed
    try:
        create_new(probe).close()
        probe.unlink()
    except OSError as err:
        raise UserError(f"{folder}: the jobs could not write their runs there ({err.strerror or err})") from None


def options(args: Any, manifest: dict[str, Any]) -> dict[str, Any]:
    """The SLURM settings of this sweep: the flags given, else those the manifest recorded."""
    saved = manifest.get("launcher", {}) if isinstance(manifest.get("launcher"), dict) else {}
    chosen = {}
    for name in ("partition", "time", "cpus_per_task", "gpus"):
        value = getattr(args, name, None)
        chosen[name] = value if value is not None else saved.get(name)
    chosen["cpus_per_task"] = chosen["cpus_per_task"] or 1
    chosen["time"] = chosen["time"] or 60
    return {"name": "slurm", **chosen}


def submit(
    folder: Path,
    manifest: dict[str, Any],
    todo: list[dict[str, Any]],
    *,
    jobs: int | None,
) -> str:
    """Submit ``todo`` as one job array; returns the array's job id. The manifest records it (status
    ``submitted``, each run's ``job``). Each task is :class:`tlm_experiments.slurm_task.RunTask`."""
    import submitit

    from tlm_experiments.manifest import write_manifest

    launcher = manifest["launcher"]
    executor = submitit.SlurmExecutor(folder=folder / LOGS / "%j")
    parameters: dict[str, Any] = {
        "job_name": f"tlm-sweep-{folder.name}"[:100],
        "time": int(launcher["time"]),
        "cpus_per_task": int(launcher["cpus_per_task"]),
        "ntasks_per_node": 1,
        "nodes": 1,
        "array_parallelism": jobs or len(todo),
        "additional_parameters": {"requeue": True},
        "setup": [f"export OMP_NUM_THREADS={int(launcher['cpus_per_task'])}"],
    }
    if launcher.get("partition"):
        parameters["partition"] = launcher["partition"]
    if launcher.get("gpus"):
        parameters["gpus_per_node"] = int(launcher["gpus"])
    executor.update_parameters(**parameters)
    from tlm_experiments.slurm_task import RunTask

    task = RunTask()
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's refusal too: said once, below
            submitted = executor.map_array(task, [str(folder)] * len(todo), [e["name"] for e in todo])
    except Exception as err:  # sbatch refused: one line, nothing marked submitted
        reason = str(err).strip().splitlines()
        detail = next((line for line in reversed(reason) if "error" in line.lower()), reason[-1] if reason else "")
        raise UserError(f"--launcher slurm: sbatch refused the job array of {len(todo)} runs: {detail}") from None
    with manifest_lock(folder):
        for entry, job in zip(todo, submitted, strict=True):
            entry.update(status="submitted", job=job.job_id)
            entry.pop("message", None)
        write_manifest(folder, manifest)
    return str(submitted[0].job_id).split("_")[0]


def queued(job_ids: list[str]) -> set[str]:
    """Which of ``job_ids`` (``ARRAY_TASK`` ids) SLURM still holds (pending, running, completing, requeued)."""
    arrays = sorted({j.split("_")[0] for j in job_ids})
    out = subprocess.run(
        ["squeue", "-h", "-r", "-j", ",".join(arrays), "-o", "%i"], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:  # an array that has ended entirely is unknown to squeue once purged
        return set()
    return set(out.stdout.split()) & set(job_ids)


def still_queued(manifest: dict[str, Any]) -> list[str]:
    """The runs of ``manifest`` whose SLURM task is still in the queue: ``--resume`` waits for them rather than
    submitting them again."""
    if shutil.which("squeue") is None:
        return []
    jobs = {e["name"]: str(e["job"]) for e in manifest["runs"] if e.get("job") and e["status"] not in FINAL}
    alive = queued(list(jobs.values())) if jobs else set()
    return [name for name, job in jobs.items() if job in alive]


def wait(folder: Path, names: list[str], *, quiet: bool) -> dict[str, Any]:
    """Wait until no task of ``names`` is in SLURM's queue; the manifest then, every run of ``names`` that did
    not record a final outcome marked failed with its log's path."""
    from tlm_experiments.manifest import read_manifest, write_manifest

    said: dict[str, str] = {}
    while True:
        manifest = read_manifest(folder)
        entries = [e for e in manifest["runs"] if e["name"] in names]
        if not quiet:
            for entry in entries:
                if said.get(entry["name"]) != entry["status"]:
                    said[entry["name"]] = entry["status"]
                    say(f"run {entry['name']} (SLURM job {entry.get('job')}): {entry['status']}")
        jobs = [str(e["job"]) for e in entries if e.get("job")]
        if not queued(jobs):
            break
        time.sleep(1.0)
    with manifest_lock(folder):
        manifest = read_manifest(folder)
        for entry in manifest["runs"]:
            if entry["name"] in names and entry["status"] not in FINAL:
                log = folder / LOGS / str(entry.get("job")) / f"{entry.get('job')}_0_log.err"
                entry.update(status="failed", message=f"its SLURM job ended without an outcome (see {log})")
        write_manifest(folder, manifest)
    return manifest
