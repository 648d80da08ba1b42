"""One run of a sweep: its settings over the sweep's base (:func:`apply`), trained to its end or resumed
(:func:`train_run`), in the sweep's own process, a ``--jobs`` worker, or a SLURM task (:func:`run_task`)."""

import os
from pathlib import Path
from typing import Any

from tlm_core.cli import say
from tlm_experiments.manifest import read_manifest, update_entry


def apply(base: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a TrainConfig dict) with the flat settings over it, ``model.X`` into its model table."""
    out = {**base, "model": dict(base.get("model", {}))}
    for key, value in flat.items():
        if key.startswith("model."):
            out["model"][key[6:]] = value
        else:
            out[key] = [value] if key in _LIST_SETTINGS and not isinstance(value, list) else value
    return out


#: TrainConfig's list settings: one value given for them (``--set data=corpus.txt``) is a list of one.
_LIST_SETTINGS = ("data", "special_tokens")


def train_run(job: dict[str, Any]) -> dict[str, Any]:
    """Train one run of a sweep to its end (resuming its folder when it holds a run): the outcome for the
    manifest. Runs in the sweep's process, or in a worker process of ``--jobs``."""
    from tlm_train import NonFiniteLossError, RunDir, TrainConfig, train

    config = TrainConfig.from_dict(job["config"])
    name = job["name"]
    if Path(config.out_dir).is_symlink():  # planted since the sweep checked its folders: nothing is written there
        return {"status": "failed", "message": f"{config.out_dir} is a symbolic link: tlm sweep never trains into one"}
    resume = RunDir(config.out_dir).config_path.is_file()
    if resume:
        config = resume_config(config)
    log = None if job["quiet"] else (lambda line: say(f"[{name}] {line}"))
    try:
        result = train(config, resume=resume, log=log, progress=False)
    except NonFiniteLossError as err:
        return {"status": "diverged", "message": str(err).splitlines()[0]}
    except Exception as err:  # one run's failure is recorded; the sweep goes on
        first = str(err).splitlines()[0] if str(err) else ""
        return {"status": "failed", "message": f"{type(err).__name__}: {first}"}
    if getattr(result, "requeued", False):  # a SLURM task stopped before its time limit and put back in the queue
        return {"status": "interrupted", "requeued": True}
    # A stop that came too late to stop the run (during its last step) still stops the sweep after it.
    return {"status": "interrupted" if result.interrupted else "done", "stop": result.stop_requested}


def resume_config(planned: Any) -> Any:
    """What a run resumes with (``tlm_train.run_dir.resume_config``): as ``tlm train --resume RUN --steps N``."""
    from tlm_train.run_dir import resume_config as resumed

    return resumed(planned)


def run_task(folder: str, name: str) -> dict[str, Any]:
    """One SLURM task: train run ``name`` of the sweep in ``folder`` and record how it ended. After a requeue
    the process ends without a result (SLURM runs the task again, which resumes the run)."""
    from tlm_train.cluster import job_id

    sweep = Path(folder)
    manifest = read_manifest(sweep)
    entry = next(e for e in manifest["runs"] if e["name"] == name)
    config = {**apply(manifest["base"], entry["settings"]), "out_dir": str(sweep / entry["name"])}
    job = {"name": name, "config": config, "quiet": False}
    update_entry(sweep, name, {"status": "running", "job": job_id()})
    outcome = train_run(job)
    outcome.pop("stop", None)  # SLURM stops the task itself: nothing else to stop
    if outcome.pop("requeued", False):
        update_entry(sweep, name, {"status": "requeued", "message": f"SLURM job {job_id()} requeued at a checkpoint"})
        os._exit(0)  # no result: the task runs again, and its result is that run's
    update_entry(sweep, name, outcome)
    return outcome
