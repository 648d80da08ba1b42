"""The callable each task of a SLURM job array runs: a class at module level, so that submitit pickles it by
reference (its module's name), not by value. Needs submitit (the ``slurm`` extra)."""

from typing import Any

import submitit

from tlm_experiments.runs import run_task


class RunTask(submitit.helpers.Checkpointable):
    """A sweep's run as submitit calls it; checkpointable, so a task that submitit itself catches being
    preempted (outside the training loop, whose own handler checkpoints) is requeued as it is."""

    def __call__(self, folder: str, name: str) -> dict[str, Any]:
        return run_task(folder, name)
