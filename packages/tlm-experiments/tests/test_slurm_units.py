"""tlm-experiments' own tests of its SLURM launcher and run wrappers, with SLURM's commands and submitit faked
(no cluster, no subprocess): which partitions are accepted, which tasks count as queued, what a refused array
says, what a submitted array records, and what one run's wrapper returns and writes. tlm-command's tests run
the same code end to end through ``tlm sweep`` with fake ``sbatch``/``squeue`` scripts."""

import json
import subprocess
from types import SimpleNamespace
from typing import ClassVar

import pytest

from tlm_core.cli import UserError
from tlm_experiments import manifest as manifest_module
from tlm_experiments import runs, slurm, sweep


def _completed(stdout="", returncode=0, stderr=""):
    return subprocess.CompletedProcess([], returncode, stdout=stdout, stderr=stderr)


@pytest.fixture
def commands(monkeypatch):
    """``commands(which=..., run=...)``: SLURM's commands as slurm.py finds and runs them."""

    def install(which=lambda name: f"/usr/bin/{name}", run=None):
        monkeypatch.setattr(slurm.shutil, "which", which)
        calls = []

        def fake_run(argv, **kwargs):
            calls.append(argv)
            return run(argv)

        monkeypatch.setattr(slurm.subprocess, "run", fake_run)
        return calls

    return install


def test_check_cluster_accepts_a_partition_sinfo_lists_and_refuses_one_it_does_not(commands):
    pytest.importorskip("submitit")
    commands(run=lambda argv: _completed("debug*\ngpu\n"))
    slurm.check_cluster("gpu")
    slurm.check_cluster("debug")  # the default partition's trailing * is not part of its name
    slurm.check_cluster(None)
    with pytest.raises(UserError) as info:
        slurm.check_cluster("cpu")
    assert str(info.value) == "--partition cpu: SLURM has no such partition (it has: debug, gpu)"
    commands(run=lambda argv: _completed(returncode=1, stderr="slurm_load_partitions: Unable to contact\n"))
    with pytest.raises(UserError, match=r"sinfo failed \(slurm_load_partitions: Unable to contact\)"):
        slurm.check_cluster(None)
    commands(which=lambda name: None)
    with pytest.raises(UserError, match="no sbatch on PATH"):
        slurm.check_cluster(None)


def test_queued_tasks_are_those_squeue_lists_of_the_arrays_asked_about(commands):
    calls = commands(run=lambda argv: _completed("77_0\n77_2\n80_1\n"))
    assert slurm.queued(["77_0", "77_1", "80_1"]) == {"77_0", "80_1"}
    assert calls == [["squeue", "-h", "-r", "-j", "77,80", "-o", "%i"]]
    commands(run=lambda argv: _completed(returncode=1))  # arrays purged from squeue: nothing is queued
    assert slurm.queued(["77_0"]) == set()


def test_still_queued_names_the_unfinished_runs_whose_task_squeue_holds(commands):
    manifest = {"runs": [{"name": "a", "status": "submitted", "job": "77_0"},
                         {"name": "b", "status": "done", "job": "77_1"},
                         {"name": "c", "status": "requeued", "job": "77_2"},
                         {"name": "d", "status": "pending"}]}  # fmt: skip
    commands(run=lambda argv: _completed("77_0\n77_1\n"))
    assert slurm.still_queued(manifest) == ["a"]
    commands(which=lambda name: None, run=lambda argv: pytest.fail("squeue run without squeue"))
    assert slurm.still_queued(manifest) == []


def _sweep_folder(tmp_path, names=("a", "b")):
    folder = tmp_path / "s"
    folder.mkdir()
    options = sweep.SweepOptions(out_dir=str(folder), grid=[f"seed={','.join('12'[: len(names)])}"])
    manifest = sweep.plan(options, folder)
    for entry, name in zip(manifest["runs"], names, strict=True):
        entry["name"] = name
    manifest["launcher"] = {"name": "slurm", "partition": "gpu", "time": 30, "cpus_per_task": 2, "gpus": 1}
    manifest_module.write_manifest(folder, manifest)
    return folder, manifest


class FakeExecutor:
    made: ClassVar[list] = []

    def __init__(self, folder, refuse=None):
        self.folder, self.refuse, self.parameters = folder, refuse, None
        FakeExecutor.made.append(self)

    def update_parameters(self, **parameters):
        self.parameters = parameters

    def map_array(self, task, folders, names):
        if self.refuse:
            raise RuntimeError(self.refuse)
        return [SimpleNamespace(job_id=f"77_{i}") for i in range(len(names))]


def test_submit_records_each_task_and_a_refused_array_is_one_line(tmp_path, monkeypatch):
    submitit = pytest.importorskip("submitit")
    folder, manifest = _sweep_folder(tmp_path)
    FakeExecutor.made.clear()
    monkeypatch.setattr(submitit, "SlurmExecutor", lambda folder: FakeExecutor(folder))
    assert slurm.submit(folder, manifest, manifest["runs"], jobs=None) == "77"
    (executor,) = FakeExecutor.made
    assert executor.parameters["array_parallelism"] == 2 and executor.parameters["partition"] == "gpu"
    assert executor.parameters["gpus_per_node"] == 1 and executor.parameters["cpus_per_task"] == 2
    written = json.loads((folder / manifest_module.MANIFEST).read_text())
    assert [(e["status"], e["job"]) for e in written["runs"]] == [("submitted", "77_0"), ("submitted", "77_1")]
    # sbatch's refusal: the line that says error, else its last line.
    for refusal, detail in (("sbatch: warning: x\nsbatch: error: Invalid account", "sbatch: error: Invalid account"),
                            ("first line\nlast line", "last line")):  # fmt: skip
        monkeypatch.setattr(submitit, "SlurmExecutor", lambda folder, refusal=refusal: FakeExecutor(folder, refusal))
        with pytest.raises(UserError) as info:
            slurm.submit(folder, manifest, manifest["runs"][:1], jobs=1)
        assert str(info.value) == f"--launcher slurm: sbatch refused the job array of 1 runs: {detail}"


def test_the_job_array_is_named_after_the_sweep_folder_cut_to_100_characters(tmp_path, monkeypatch):
    """The cap of 100 is the launcher's own choice, pinned here; so is that the name is the folder's,
    kept whole when it fits and cut, never refused, when it does not."""
    submitit = pytest.importorskip("submitit")
    folder, manifest = _sweep_folder(tmp_path)
    monkeypatch.setattr(submitit, "SlurmExecutor", lambda folder: FakeExecutor(folder))
    for name in ("s", "x" * 90, "y" * 200):
        renamed = folder.rename(tmp_path / name)
        FakeExecutor.made.clear()
        slurm.submit(renamed, manifest, manifest["runs"][:1], jobs=None)
        (executor,) = FakeExecutor.made
        assert executor.parameters["job_name"] == f"tlm-sweep-{name}"[:100]
        assert len(executor.parameters["job_name"]) == min(100, len("tlm-sweep-") + len(name))
        folder = renamed


def test_run_on_slurm_submits_only_the_unfinished_runs_afresh(tmp_path, monkeypatch):
    folder, manifest = _sweep_folder(tmp_path)
    manifest["runs"][0].update(status="done", job="70_0")
    manifest["runs"][1].update(status="failed", job="70_1")
    submitted = []
    monkeypatch.setattr(slurm, "check_writable", lambda folder: None)
    monkeypatch.setattr(slurm, "still_queued", lambda manifest: [])
    monkeypatch.setattr(slurm, "submit", lambda folder, manifest, todo, jobs: submitted.append(todo) or "77")
    monkeypatch.setattr(slurm, "wait", lambda folder, names, quiet: {"waited for": names})
    args = sweep.SweepOptions(jobs=None, quiet=True)
    assert sweep._run_on_slurm(folder, manifest, args) == ({"waited for": ["b"]}, True)
    assert submitted == [[{"name": "b", "settings": manifest["runs"][1]["settings"], "status": "pending"}]]
    manifest["runs"][1]["status"] = "done"  # nothing left to run: nothing submitted
    assert sweep._run_on_slurm(folder, manifest, args) == (manifest, True) and len(submitted) == 1
    monkeypatch.setattr(slurm, "still_queued", lambda manifest: ["b"])
    with pytest.raises(UserError, match=r"runs \['b'\] are still in SLURM's queue"):
        sweep._run_on_slurm(folder, manifest, args)


def _job(tmp_path, quiet=True):
    from tlm_train import TrainConfig

    return {"name": "a", "config": TrainConfig(out_dir=str(tmp_path / "a")).to_dict(), "quiet": quiet}


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (SimpleNamespace(interrupted=False, stop_requested=False), {"status": "done", "stop": False}),
        (SimpleNamespace(interrupted=True, stop_requested=True), {"status": "interrupted", "stop": True}),
        (SimpleNamespace(interrupted=True, stop_requested=True, requeued=True),
         {"status": "interrupted", "requeued": True}),
        (ValueError("bad\nsecond line"), {"status": "failed", "message": "ValueError: bad"}),
        ("non-finite", {"status": "diverged", "message": "loss is nan at step 3"}),
    ],
)  # fmt: skip
def test_train_run_trains_quietly_once_and_says_how_the_run_ended(tmp_path, monkeypatch, outcome, expected):
    import tlm_train

    calls = []

    def fake_train(config, **kwargs):
        calls.append((config.out_dir, kwargs))
        if outcome == "non-finite":
            raise tlm_train.NonFiniteLossError("loss is nan at step 3\nmore")
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(tlm_train, "train", fake_train)
    assert runs.train_run(_job(tmp_path)) == expected
    assert calls == [(str(tmp_path / "a"), {"resume": False, "log": None, "progress": False})]


def test_run_task_records_the_outcome_without_the_local_stop_flag(tmp_path, monkeypatch):
    folder, _ = _sweep_folder(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "91")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setattr(runs, "train_run", lambda job: {"status": "done", "stop": True})
    assert runs.run_task(str(folder), "a") == {"status": "done"}
    entry = json.loads((folder / manifest_module.MANIFEST).read_text())["runs"][0]
    assert (entry["status"], entry["job"], "stop" in entry) == ("done", "91", False)


def test_options_take_the_flags_given_else_those_recorded_else_the_defaults():
    recorded = {"launcher": {"partition": "gpu", "time": 30, "cpus_per_task": 4, "gpus": 2}}
    none = SimpleNamespace(partition=None, time=None, cpus_per_task=None, gpus=None)
    assert slurm.options(none, recorded) == {"name": "slurm", "partition": "gpu", "time": 30, "cpus_per_task": 4,
                                             "gpus": 2}  # fmt: skip
    given = SimpleNamespace(partition="cpu", time=5, cpus_per_task=None, gpus=None)
    assert slurm.options(given, recorded) == {"name": "slurm", "partition": "cpu", "time": 5, "cpus_per_task": 4,
                                              "gpus": 2}  # fmt: skip
    assert slurm.options(none, {}) == {"name": "slurm", "partition": None, "time": 60, "cpus_per_task": 1,
                                       "gpus": None}  # fmt: skip


def test_a_runs_bits_per_byte_ratio_comes_from_its_first_scored_record(tmp_path):
    from tlm_experiments import compare
    from tlm_train import RunDir, TrainConfig

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_config(TrainConfig(out_dir=str(run.path)))
    records = [{"step": 0, "val_loss": 0.0, "val_bpb": 0.0}, {"step": 1, "val_loss": 0.5, "val_bpb": 0.7},
               {"step": 2, "val_loss": 0.4, "val_bpb": 0.6}]  # fmt: skip
    assert compare.run_data(run.path, records).bpb_per_nat == pytest.approx(0.7 / 0.5)  # a loss of 0 says nothing


def test_the_summary_is_written_with_its_title(tmp_path):
    folder, manifest = _sweep_folder(tmp_path)
    sweep.write_summary(folder, manifest, quiet=True)
    assert (folder / sweep.SUMMARY_MD).read_text(encoding="utf-8").startswith(f"# Sweep {folder.name}\n\n")
    assert json.loads((folder / sweep.SUMMARY_JSON).read_text())["format"] == sweep.FORMAT


def test_the_writable_probe_never_follows_a_symlink_and_leaves_nothing(tmp_path):
    import os

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    folder = tmp_path / "sweep"
    folder.mkdir()
    (folder / f".write-test-{os.getpid()}").symlink_to(victim)  # where the probe used to go, by its pid
    slurm.check_writable(folder)
    assert victim.read_bytes() == b"keep"
    assert os.listdir(folder) == [f".write-test-{os.getpid()}"]  # the probe itself removed
    folder.chmod(0o500)
    try:
        if not os.access(folder, os.W_OK):  # root writes anywhere
            with pytest.raises(UserError, match=f"{folder}: the jobs could not write their runs there"):
                slurm.check_writable(folder)
    finally:
        folder.chmod(0o700)
