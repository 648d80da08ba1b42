"""Training on a SLURM cluster: the distributed world from ``srun``, and a preemption or time-limit signal
turned into a checkpoint, an exit and a requeue.

- :func:`slurm_world`: under ``srun`` (one task per rank), torchrun's variables (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``) from SLURM's (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
  ``SLURM_LOCALID``, the step's first node). Under ``srun torchrun`` torchrun's own win.
- :class:`StopSignals`: SIGINT, SIGTERM (preemption, ``scancel``, ``scontrol requeue``), SIGUSR1 and SIGUSR2
  (``sbatch --signal=USR1@N`` before the time limit; submitit's is USR2) ask the loop to checkpoint at the next
  step boundary and return. A second signal during the save changes nothing (a second SIGINT alone interrupts
  at once, as Ctrl-C twice does at a terminal). After a stop, SIGUSR1 and SIGUSR2 are ignored (not fatal).
- :class:`StopPoll`: the ranks agree on the stop (and on the requeue) each step, through an all-reduce on a
  gloo group of its own started one step and read the next: no device sync, one step late at most.
- :func:`requeue_job`: after a SIGUSR1/SIGUSR2 stop, rank 0 puts the job back in the queue
  (``scontrol requeue``); the job's script runs again and ``tlm train --auto-resume`` (implied in a requeued job)
  continues from the newest complete checkpoint: :func:`auto_resume_config`.
"""

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

#: Signals that ask a run to checkpoint and stop; the last two also ask for the job to be requeued.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
#: MASTER_PORT under srun when none is set: this base plus the job id modulo PORT_SPAN (each job its own).
PORT_BASE, PORT_SPAN = 20000, 20000


def slurm_world(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """torchrun's variables for this ``srun`` task; empty outside an ``srun`` step of several tasks (a batch
    script itself, one task) or when ``WORLD_SIZE`` is set already (``srun torchrun``, or set by hand)."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env or "SLURM_STEP_NUM_TASKS" not in env or "SLURM_PROCID" not in env:
        return {}
    tasks = int(env["SLURM_STEP_NUM_TASKS"])
    if tasks <= 1:
        return {}
    nodes = int(env.get("SLURM_STEP_NUM_NODES", "1"))
    world = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": env.get("MASTER_ADDR") or ("127.0.0.1" if nodes == 1 else first_node(env)),
        "MASTER_PORT": env.get("MASTER_PORT") or str(PORT_BASE + int(env.get("SLURM_JOB_ID", "0")) % PORT_SPAN),
    }
    return world


def first_node(environ: Mapping[str, str]) -> str:
    """The first host of the step's node list (``node[03-05,09]`` -> ``node03``), by ``scontrol show hostnames``
    when it is there, else read from the list itself."""
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ["SLURM_NODELIST"]
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    match = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist)
    if match is None:
        raise ValueError(f"SLURM_NODELIST {nodelist!r}: not a node list")
    return match.group(1) + (match.group(2) or "")


class StopSignals:
    """While entered, the stop signals are caught: :attr:`requested` (any), :attr:`requeue` (SIGUSR1/SIGUSR2).
    Outside the main thread, signals stay as they are."""

    def __init__(self) -> None:
        self.requested = False
        self.requeue = False
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT and signal.SIGINT in self.received:
            raise KeyboardInterrupt  # Ctrl-C twice: at once
        self.received.append(signum)
        self.requested = True
        self.requeue = self.requeue or signum in REQUEUE_SIGNALS

    def __enter__(self) -> "StopSignals":
        try:
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        except ValueError:  # not the main thread
            self._previous = {}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._previous.items():
            # After a stop, SIGUSR1/SIGUSR2 that would end the process (their default) are ignored instead: more
            # time-limit warnings come while the run winds down, and its checkpoint is written already.
            moot = self.requested and sig in REQUEUE_SIGNALS and old == signal.SIG_DFL
            signal.signal(sig, signal.SIG_IGN if moot else old)
        self._previous = {}


class StopPoll:
    """The ranks' agreement on (stop, requeue): :meth:`poll` each step on every rank, with this rank's flags; it
    returns the flags of any rank as of the previous call (the all-reduce started then on a gloo group of its
    own, so neither the device nor the training's collectives wait for it). One process: its own flags."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None
        self._pending: tuple[Any, torch.Tensor] | None = None

    def poll(self, stop: bool, requeue: bool) -> tuple[bool, bool]:
        if self._group is None:
            return stop, requeue
        agreed = (False, False)
        if self._pending is not None:
            work, value = self._pending
            work.wait()
            agreed = (bool(value[0]), bool(value[1]))
        value = torch.tensor([int(stop), int(requeue)], dtype=torch.int32)
        self._pending = (dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._group, async_op=True), value)
        return agreed

    def close(self) -> None:
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The id ``scontrol requeue`` takes for this job (``ARRAY_TASK`` form for a job array's task); None outside
    SLURM."""
    env = os.environ if environ is None else environ
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def requeue_job(say: Callable[[str], None]) -> bool:
    """Put this SLURM job back in the queue (``scontrol requeue``); says what happened in one line. False outside
    SLURM or when it fails (the checkpoint is written either way: resubmit the job)."""
    job = job_id()
    if job is None:
        return False
    if shutil.which("scontrol") is None:
        say(f"SLURM job {job}: no scontrol on PATH, so the job was not requeued; resubmit it to continue")
        return False
    out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        reason = (out.stderr or out.stdout).strip().splitlines()
        say(f"scontrol requeue {job} failed ({reason[-1] if reason else out.returncode}); resubmit the job to continue")
        return False
    say(f"SLURM job {job} requeued: it continues from this checkpoint when it runs again")
    return True


def requeued(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs in a SLURM job that was requeued (``SLURM_RESTART_COUNT`` above 0)."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get("SLURM_RESTART_COUNT", "0")) > 0
    except ValueError:
        return False


def auto_resume_config(planned: Any) -> Any:
    """What ``planned`` (a TrainConfig) resumes with when its ``out_dir`` holds a run already: the run's own
    ``train.toml`` with the planned settings that a resume may change over it (steps, learning rate,
    intervals...); the model, data, tokenizer and seed stay the run's. None when the folder holds no run yet."""
    from tlm_train.run_dir import RunDir, resume_config

    if not RunDir(planned.out_dir).config_path.is_file():
        return None
    return resume_config(planned)


__all__ = [
    "REQUEUE_SIGNALS",
    "STOP_SIGNALS",
    "StopPoll",
    "StopSignals",
    "auto_resume_config",
    "first_node",
    "job_id",
    "requeue_job",
    "requeued",
    "slurm_world",
]
