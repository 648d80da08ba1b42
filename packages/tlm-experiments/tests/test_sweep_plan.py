"""tlm_experiments.sweep on its own, without training (tlm-command's ``tlm sweep`` tests train through the command
line): how settings are named, which path trains a sweep's last run, whose status the summary takes, and a folder
that already holds a sweep. The names expected come from TrainConfig's and ModelConfig's own fields."""

import dataclasses
import json

import pytest

from tlm_core.cli import UserError
from tlm_experiments import sweep
from tlm_experiments.manifest import MANIFEST, write_manifest
from tlm_experiments.sweep import SweepOptions
from tlm_model import ModelConfig
from tlm_train import TrainConfig


def test_a_model_setting_is_named_model_dot_field_given_either_way_and_a_name_of_neither_is_refused(tmp_path):
    assert "d_model" in {f.name for f in dataclasses.fields(ModelConfig)}
    assert "d_model" not in {f.name for f in dataclasses.fields(TrainConfig)}
    for given in ("model.d_model", "d_model", "d-model"):
        manifest = sweep.plan(SweepOptions(out_dir="x", grid=[f"{given}=32,64"]), tmp_path)
        assert [e["settings"] for e in manifest["runs"]] == [{"model.d_model": 32}, {"model.d_model": 64}]
    manifest = sweep.plan(SweepOptions(out_dir="x", grid=["lr=1e-3"], set=["model.num_layers=3"]), tmp_path)
    assert manifest["base"]["model"]["num_layers"] == 3
    for wrong in ("model.lr", "model.nothing", "nothing"):
        with pytest.raises(UserError, match=f"^--grid {wrong}: not a setting; expected a TrainConfig field"):
            sweep.plan(SweepOptions(out_dir="x", grid=[f"{wrong}=1,2"]), tmp_path)


def test_the_last_run_left_trains_in_this_process_whatever_jobs_says(tmp_path, monkeypatch):
    """One run needs no pool of worker processes: it trains here, with this process's threads."""
    folder = tmp_path / "s"
    manifest = sweep.plan(SweepOptions(out_dir=str(folder), grid=["lr=1e-3,2e-3"]), folder)
    manifest["runs"][0]["status"] = "done"
    folder.mkdir()
    trained = []

    def train_here(job):
        import torch

        trained.append((job["name"], torch.get_num_threads()))
        return {"status": "done"}

    monkeypatch.setattr(sweep, "train_run", train_here)  # a pool's spawned worker would not see this
    assert sweep.Sweep(folder, manifest, jobs=4, quiet=True).run() is True
    assert trained == [("lr=2e-3", sweep.threads_per_run(1))]
    assert [e["status"] for e in json.loads((folder / MANIFEST).read_text())["runs"]] == ["done", "done"]


def test_the_summary_takes_a_failed_or_diverged_status_from_the_manifest_over_the_runs_records(hand_run, tmp_path):
    finished = [{"step": 0, "val_loss": 4.0, "time_s": 0.5}, {"step": 4, "train_loss": 3.3, "val_loss": 3.2}]
    runs = []
    for name, status in (("a", "done"), ("b", "failed"), ("c", "diverged")):
        hand_run(tmp_path / name, finished)  # every folder's records say it finished
        runs.append({"name": name, "settings": {}, "status": status, "message": f"{name} said so"})
    summaries = sweep.summarize(tmp_path, {"runs": runs})
    assert [(s.name, s.path, s.status) for s in summaries] == [("a", "a", "done"), ("b", "b", "failed"),
                                                               ("c", "c", "diverged")]  # fmt: skip
    assert [s.message for s in summaries] == [None, "b said so", None]
    assert [s.final_val_loss for s in summaries] == [3.2, None, None]


def test_an_out_dir_that_holds_a_sweep_is_refused_with_the_resume_that_continues_it(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    write_manifest(folder, sweep.plan(SweepOptions(out_dir=str(folder), grid=["lr=1e-3"]), folder))
    before = (folder / MANIFEST).read_bytes()
    with pytest.raises(UserError) as caught:
        sweep.run(SweepOptions(out_dir=str(folder), grid=["lr=1e-3"]))
    assert str(caught.value) == f"--out-dir {folder} already holds a sweep: continue it with --resume {folder}"
    assert (folder / MANIFEST).read_bytes() == before and sorted(folder.iterdir()) == [folder / MANIFEST]


def test_a_slurm_sweep_checks_its_cluster_and_partition_before_anything_is_written(tmp_path, monkeypatch):
    # _launcher's promise: SLURM there and the partition known, checked before the sweep writes anything. The
    # cluster's answer stands in (test_slurm_units.py checks check_cluster itself against a fake sinfo).
    from tlm_experiments import slurm

    asked = []

    def check_cluster(partition):
        asked.append(partition)
        raise UserError(f"--partition {partition}: not a partition of this cluster")

    monkeypatch.setattr(slurm, "check_cluster", check_cluster)
    manifest = {}
    with pytest.raises(UserError, match="^--partition cpu: not a partition"):
        sweep._launcher(SweepOptions(out_dir=str(tmp_path / "s"), launcher="slurm", partition="cpu"), manifest)
    assert asked == ["cpu"] and not (tmp_path / "s").exists()
