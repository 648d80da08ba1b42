"""``tlm sweep`` and ``tlm compare`` on hostile input: a manifest edited by hand or planted, run names that are not
one folder name, symlinks planted where a sweep writes, metrics records of the wrong shape, plans too big to
make. Each is refused in one line naming the file or field, and nothing outside the sweep folder changes."""

import json
import os

import pytest

from tlm_experiments import manifest as manifest_module
from tlm_experiments import sweep

BASE = {"steps": 2, "vocab_size": 32, "model": {"context_length": 16, "d_model": 32, "num_layers": 1,
                                                "num_heads": 2, "d_ff": 64}}  # fmt: skip


def _manifest(folder, runs, **fields):
    folder.mkdir(exist_ok=True)
    data = {"format": sweep.FORMAT, "base": BASE, "runs": runs, **fields}
    (folder / "sweep.json").write_text(json.dumps(data))
    return folder / "sweep.json"


def _entry(name="a", settings=None, status="pending"):
    return {"name": name, "settings": {} if settings is None else settings, "status": status}


@pytest.mark.parametrize(
    ("runs", "fields", "words"),
    [
        ([{"settings": {}, "status": "pending"}], {}, "runs[0] has no name"),
        ([{"name": "a", "status": "pending"}], {}, "runs[0] has no settings"),
        ([{"name": "a", "settings": {}}], {}, "runs[0] has no status"),
        ([_entry(settings=["lr", 1])], {}, 'runs[0].settings must be a table of settings, got ["lr", 1]'),
        ([_entry(settings="lr=1")], {}, "runs[0].settings must be a table of settings"),
        ([_entry(name="../x")], {}, "runs[0].name: '../x' is not a plain folder name"),
        ([_entry(name="/tmp/x")], {}, "runs[0].name: '/tmp/x' is not a plain folder name"),
        ([_entry(name="..")], {}, "runs[0].name: '..' is not a plain folder name"),
        ([_entry(name="sweep.json")], {}, "runs[0].name: 'sweep.json' is not a plain folder name"),
        ([_entry(name=7)], {}, "runs[0].name: expected a text name, got int"),
        ([_entry(name="a" * 256)], {}, "runs[0].name: '" + "a" * 40 + "'... is 256 bytes long, over the 255"),
        ([_entry(), _entry()], {}, "runs[1].name: 'a' is given twice"),
        ([_entry(status="finished")], {}, "runs[0].status must be one of pending, running,"),
        ([_entry(), "b"], {}, 'runs[1] must be a table with name, settings and status, got "b"'),
        ([{**_entry(), "message": 3}], {}, "runs[0].message must be text, got 3"),
        ({"a": {}}, {}, "runs must be a list of one or more runs"),
        ([], {}, "runs must be a list of one or more runs, got []"),
        ([_entry()], {"base": []}, "base must be a table of settings"),
        ([_entry()], {"base": {"model": 3}}, "base must be a table of settings (model a table in it), got"),
        ([_entry()], {"jobs": 0}, "jobs must be a positive integer, got 0"),
        ([_entry()], {"jobs": True}, "jobs must be a positive integer, got true"),
    ],
)
def test_a_manifest_is_checked_field_by_field_by_sweep_and_compare(tmp_path, fails, runs, fields, words) -> None:
    folder = tmp_path / "sweep"
    path = _manifest(folder, runs, **fields)
    before = sorted(os.listdir(tmp_path))
    fails(["sweep", "--resume", str(folder)], f"{path}: {words}")
    fails(["compare", str(folder)], f"{path}: {words}")
    assert sorted(os.listdir(tmp_path)) == before and sorted(os.listdir(folder)) == ["sweep.json"]


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"lr": "fast"}, "runs[0] (a): lr must be a number, got str ('fast')"),
        ({"no_such": 1}, "runs[0] (a): unknown training settings ['no_such']"),
        ({"model.d_model": 33}, "runs[0] (a): model.d_model must be divisible by num_heads"),
    ],
)
def test_a_resumed_runs_settings_are_checked_as_a_train_config_before_anything_is_written(
    tmp_path, fails, settings, words
) -> None:
    folder = tmp_path / "sweep"
    path = _manifest(folder, [_entry(settings=settings)])
    fails(["sweep", "--resume", str(folder)], f"{path}: {words}")
    assert sorted(os.listdir(folder)) == ["sweep.json"]


def test_run_names_from_a_grid_or_a_runs_file_are_one_folder_name(tmp_path, fails) -> None:
    runs = tmp_path / "runs.toml"
    runs.write_text(f'[runs."{"b" * 256}"]\n')
    fails(["sweep", "--out-dir", str(tmp_path / "s"), "--runs", str(runs)], "run name: 'bbbb", "over the 255")
    runs.write_text('[runs."../x"]\n')
    fails(["sweep", "--out-dir", str(tmp_path / "s"), "--runs", str(runs)], "run name: '../x' is not a plain")
    fails(["sweep", "--out-dir", str(tmp_path / "s"), "--grid", "data=/etc/x"], "run name: 'data=/etc/x' is not")
    assert sorted(os.listdir(tmp_path)) == ["runs.toml"]  # a refused plan leaves no sweep folder behind


def test_a_name_is_checked_by_one_rule() -> None:
    assert manifest_module.name_problem("lr=1e-3,d_model=32") is None
    assert manifest_module.name_problem("a" * 255) is None
    for bad in ("", ".hidden", "a/b", "a\\b", "é", "a b", ".lock", "summary.md"):
        assert manifest_module.name_problem(bad) is not None, bad


def _run_folder(folder, metrics: bytes):
    """A run folder as tlm train leaves it (train.toml), with ``metrics`` as its metrics.jsonl."""
    from tlm_train import TrainConfig

    config = TrainConfig(out_dir=str(folder), **BASE)
    folder.mkdir()
    (folder / "train.toml").write_text(config.replace(model=config.model_config(32).to_dict(drop_none=True)).to_toml())
    (folder / "metrics.jsonl").write_bytes(metrics)
    return folder / "metrics.jsonl"


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (b'{"val_loss": 3.0, "time_s": 1.0}', "line 2: expected a record with an integer step >= 0, got no step"),
        (
            b'{"step": Infinity, "train_loss": 3.0}',
            "line 2: expected a record with an integer step >= 0, got step Infinity",
        ),
        (b'{"step": 1e400, "val_loss": 3.0}', "got step Infinity"),
        (b'{"step": NaN, "val_loss": 3.0}', "got step NaN"),
        (b'{"step": "2", "val_loss": 3.0}', 'got step "2"'),
        (b'{"step": 2.0, "val_loss": 3.0}', "got step 2.0"),
        (b'{"step": -1, "val_loss": 3.0}', "got step -1"),
        (b'{"step": true, "val_loss": 3.0}', "got step true"),
        (b"[2, 3.0]", "line 2: expected a record with an integer step >= 0, got a list, not an object"),
        (b"7", "got a int, not an object"),
        (b'{"step": 2, "val_loss": "\xff"}', "not UTF-8 text (invalid start byte at byte 69)"),
    ],
)
def test_compare_refuses_a_metrics_record_of_the_wrong_shape_in_one_line_naming_the_file(
    tmp_path, fails, line, words
) -> None:
    metrics = _run_folder(tmp_path / "run", b'{"step": 0, "val_loss": 4.0, "time_s": 0.5}\n' + line + b"\n")
    fails(["compare", str(tmp_path / "run")], f"tlm: error: {metrics}: ", words)


def test_compare_drops_only_a_last_line_cut_short(tmp_path, capsys) -> None:
    from tlm_command.main import main

    _run_folder(tmp_path / "run", b'{"step": 0, "val_loss": 4.0, "time_s": 0.5}\n{"step": 2, "val_lo')
    assert main(["compare", str(tmp_path / "run"), "--json"]) == 0
    (summary,) = json.loads(capsys.readouterr().out)["runs"]
    assert (summary["steps"], summary["best_val_loss"], summary["status"]) == (0, 4.0, "interrupted")


def test_a_plan_over_max_runs_is_refused_with_its_size_before_anything_is_made(
    tmp_path, fails, monkeypatch, capsys
) -> None:
    import itertools

    def no_product(*args, **kwargs):
        raise AssertionError("the product was made before its size was checked")

    out = tmp_path / "sweep"
    thousand = ",".join(f"{i + 1}e-5" for i in range(1000))
    with monkeypatch.context() as patch:
        patch.setattr(itertools, "product", no_product)
        fails(["sweep", "--out-dir", str(out), "--grid", f"lr={thousand}", "--grid", f"seed={thousand}"],
              "--grid: 1000 x 1000 = 1,000,000 runs, more than --max-runs 1,000")  # fmt: skip
        fails(["sweep", "--out-dir", str(out), "--grid", "lr=1,2,3", "--grid", "seed=1,2", "--max-runs", "5"],
              "--grid: 3 x 2 = 6 runs, more than --max-runs 5")  # fmt: skip
    runs = tmp_path / "runs.toml"
    runs.write_text("".join(f"[runs.r{i}]\n" for i in range(4)))
    fails(["sweep", "--out-dir", str(out), "--runs", str(runs), "--max-runs", "3"], f"--runs {runs}: 4 runs, more")
    assert sorted(os.listdir(tmp_path)) == ["runs.toml"]
    # At the limit, the plan is made.
    grid = sweep.SweepOptions(grid=["lr=1e-3,2e-3,3e-3", "seed=1,2"], max_runs=6)
    assert len(sweep.plan(grid, out)["runs"]) == 6
    by_file = sweep.SweepOptions(runs=str(runs), max_runs=4)
    assert [r["name"] for r in sweep.plan(by_file, out)["runs"]] == ["r0", "r1", "r2", "r3"]
    assert sweep.MAX_RUNS == 1000 and not out.exists()
    from tlm_command.main import main

    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "--max-runs MAX_RUNS refuse a plan of more runs than this (its size said) (default: 1000)" in said


@pytest.mark.slow  # two short trainings (~4 s)
def test_a_resume_reapplies_only_what_a_resume_may_change_so_a_small_vocabulary_resumes(tmp_path, capsys) -> None:
    from tlm_command.main import main
    from tlm_train import MetricsLog, RunDir

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("ab ab ba. " * 300)  # a few merges at most: the BPE stops far below 300 tokens
    settings = {"vocab_size": 300, "steps": 2, "batch_size": 4, "eval_batches": 1, "eval_interval": 2,
                "checkpoint_interval": 2, "warmup_steps": 0, "peak_flops": 1e9, "sample_tokens": 0,
                "context_length": 8, "d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32,
                "data": corpus}  # fmt: skip
    folder = tmp_path / "sweep"
    sets = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    assert main(["sweep", "--out-dir", str(folder), "--grid", "lr=1e-3", "--quiet", "--jobs", "1", *sets]) == 0
    run = RunDir(folder / "lr=1e-3")
    reached = run.read_config().vocab_size
    assert reached < 300
    # As a sweep killed mid-run leaves it, with two more steps planned (a setting a resume may change) and a seed
    # that differs from the run's (one it may not: the run keeps its own).
    manifest = json.loads((folder / "sweep.json").read_text())
    manifest["runs"][0]["status"] = "running"
    manifest["base"].update(steps=4, seed=1234)
    (folder / "sweep.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["sweep", "--resume", str(folder), "--jobs", "1"]) == 0, capsys.readouterr().err
    assert "[lr=1e-3] resumed from step 2" in capsys.readouterr().err
    assert sweep.read_manifest(folder)["runs"][0]["status"] == "done"
    resumed = run.read_config()
    assert (resumed.steps, resumed.vocab_size, resumed.seed) == (4, reached, 0)
    assert run.checkpoints().steps()[-1] == 4
    assert [r["changed"] for r in MetricsLog(run.metrics_path).read() if r.get("event") == "resume"] == [{"steps": 4}]


def test_the_last_remaining_run_trains_in_this_process_with_every_thread(tmp_path, monkeypatch) -> None:
    """With --jobs 2 and one run left to train (the other finished), the run is not sent to a worker process: it
    trains here, with all the sweep's threads, which are given back after; two runs left go to the workers."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    seen = []

    def fake_train_run(job):
        seen.append((job["name"], os.getpid(), torch.get_num_threads()))
        return {"status": "done"}

    def no_pool(self, todo):
        raise AssertionError("the last run was sent to a worker pool")

    monkeypatch.setattr(sweep, "train_run", fake_train_run)
    monkeypatch.setattr(sweep.Sweep, "_at_once", no_pool)
    folder = tmp_path / "sweep"
    folder.mkdir()
    manifest = {"format": sweep.FORMAT, "base": BASE, "runs": [_entry("a", status="done"), _entry("b")]}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert sweep.Sweep(folder, manifest, jobs=2, quiet=True).run()
        assert seen == [("b", os.getpid(), 2)] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert [r["status"] for r in json.loads((folder / "sweep.json").read_text())["runs"]] == ["done", "done"]
    pooled = []
    monkeypatch.setattr(sweep.Sweep, "_at_once", lambda self, todo: pooled.append([e["name"] for e in todo]) or True)
    manifest["runs"][0]["status"] = manifest["runs"][1]["status"] = "failed"
    assert sweep.Sweep(folder, manifest, jobs=2, quiet=True).run() and pooled == [["a", "b"]]


def _snapshot(folder):
    """Every file under ``folder``: its path, mode and bytes (to prove nothing changed)."""
    return {str(p.relative_to(folder)): (p.stat().st_mode, p.read_bytes()) for p in sorted(folder.rglob("*"))
            if p.is_file()}  # fmt: skip


@pytest.mark.slow  # two sweeps of two 2-step runs (~4 s)
def test_symlinks_planted_where_a_sweep_a_comparison_and_tensorboard_write_are_never_followed(
    tmp_path, fails, capsys
) -> None:
    import numpy as np

    from tlm_command.main import main

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.tile(np.random.default_rng(0).integers(0, 32, 50), 40).astype(np.uint16))
    outside = tmp_path / "outside"
    (outside / "run").mkdir(parents=True)
    (outside / "tensorboard").mkdir()
    names = ("sweep.json", "summary.json", "summary.md", "sweep.png", "lock", "compare.png")
    for name in names:
        (outside / name).write_text(f"the user's own {name}\n")
    (outside / "run" / "train.toml").write_text("# the user's own run\n")
    (outside / "tensorboard" / "notes.txt").write_text("the user's own notes\n")
    folder = tmp_path / "sweep"
    base = {
        **BASE,
        "data": [str(tokens)],
        "batch_size": 4,
        "eval_batches": 1,
        "eval_interval": 2,
        "checkpoint_interval": 2,
        "warmup_steps": 0,
        "peak_flops": 1e9,
        "sample_tokens": 0,
        "tensorboard": True,
    }
    path = _manifest(folder, [_entry("a"), _entry("b")], base=base)  # fmt: skip
    (outside / "sweep.json").write_bytes(path.read_bytes())
    before = _snapshot(outside)

    (folder / ".lock").symlink_to(outside / "lock")
    fails(["sweep", "--resume", str(folder)], f"{folder / '.lock'} is a symbolic link: tlm sweep never follows one")
    (folder / ".lock").unlink()
    (folder / "a").symlink_to(outside / "run", target_is_directory=True)
    fails(["sweep", "--resume", str(folder)], f"{folder / 'a'} is a symbolic link: tlm sweep never trains into one")
    (folder / "a").unlink()
    assert _snapshot(outside) == before

    # The manifest, the summaries and the plot are symlinks, and so is run b's RUN/tensorboard.
    path.unlink()
    for name in names[:4]:
        (folder / name).symlink_to(outside / name)
    (folder / "b").mkdir()
    (folder / "b" / "tensorboard").symlink_to(outside / "tensorboard", target_is_directory=True)
    assert main(["sweep", "--resume", str(folder), "--jobs", "1", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.endswith("tlm: error: runs ['b'] failed (see " + str(path) + "); retry them with --resume\n"), err
    message = sweep.read_manifest(folder)["runs"][1]["message"]
    refused = f"{folder / 'b' / 'tensorboard'} is a symbolic link: tlm train never writes through one; remove it"
    assert message.startswith(f"ValueError: {refused} (to keep tensorboard on another disk, ")
    assert _snapshot(outside) == before
    assert not any((folder / name).is_symlink() for name in names[:3])  # each replaced by the sweep's own file
    (folder / "b" / "tensorboard").unlink()
    assert main(["sweep", "--resume", str(folder), "--jobs", "1", "--quiet"]) == 0
    assert [r["status"] for r in sweep.read_manifest(folder)["runs"]] == ["done", "done"]

    # tlm compare's plot; TensorBoard's events are the runs' own.
    (tmp_path / "compare.png").symlink_to(outside / "compare.png")
    assert main(["compare", str(folder), "--out", str(tmp_path / "compare.png")]) == 0
    assert not (tmp_path / "compare.png").is_symlink()
    assert _snapshot(outside) == before
    for run in ("a", "b"):
        tensorboard = folder / run / "tensorboard"
        assert not tensorboard.is_symlink() and [p.name[:20] for p in tensorboard.iterdir()] == ["events.out.tfevents."]
    # A finished run's folder replaced by a symlink: neither command reads through it.
    (folder / "a").rename(tmp_path / "elsewhere")
    (folder / "a").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    capsys.readouterr()
    fails(["compare", str(folder)], f"{folder / 'a'} is a symbolic link: a sweep's runs are folders of their own")
    fails(["sweep", "--resume", str(folder)], f"{folder / 'a'} is a symbolic link: tlm sweep never trains into one")
    assert [s.name for s in sweep.summarize(folder, sweep.read_manifest(folder))] == ["b"]


def test_one_sweep_at_a_time_and_a_run_folder_planted_as_a_link_mid_sweep_fails_that_run(tmp_path, fails) -> None:
    from tlm_train.run_dir import RunLock

    folder = tmp_path / "sweep"
    _manifest(folder, [_entry("a")])
    holder = RunLock(folder / ".lock", command="tlm sweep")  # another sweep holds the folder
    try:
        fails(["sweep", "--resume", str(folder)], f"{folder} is in use by another tlm sweep; wait for it to finish")
    finally:
        holder.release()
    (tmp_path / "outside").mkdir()
    (folder / "a").symlink_to(tmp_path / "outside", target_is_directory=True)  # planted after the sweep's check
    job = sweep.Sweep(folder, json.loads((folder / "sweep.json").read_text()), jobs=1, quiet=True).job(_entry("a"))
    outcome = sweep.train_run(job)
    assert outcome == {"status": "failed", "message": f"{folder / 'a'} is a symbolic link: tlm sweep never trains "
                                                      "into one"}  # fmt: skip
    assert list((tmp_path / "outside").iterdir()) == []


def test_a_manifest_of_another_format_or_shape_is_one_line(tmp_path, fails) -> None:
    folder = tmp_path / "sweep"
    fails(["sweep", "--resume", str(folder)], f"{folder}: not a sweep folder (no sweep.json in it)")
    folder.mkdir()
    for data in ({"base": BASE, "runs": [_entry()]}, {"format": "tlm-sweep/2"}, [sweep.FORMAT]):
        (folder / "sweep.json").write_text(json.dumps(data))
        fails(["compare", str(folder)], f"{folder / 'sweep.json'} is not a tlm-sweep/1 manifest")


def test_the_manifest_checks_bound_jobs_and_shorten_what_they_quote() -> None:
    check = manifest_module.check_manifest
    good = {"format": sweep.FORMAT, "base": BASE, "runs": [_entry()]}
    check({**good, "jobs": 1}, "m")  # the smallest number of jobs, and none (the default)
    check(good, "m")
    for jobs, shown in ((0, "0"), ("2", '"2"'), (2.0, "2.0"), (False, "false")):
        with pytest.raises(manifest_module.UserError, match=f"^m: jobs must be a positive integer, got {shown}$"):
            check({**good, "jobs": jobs}, "m")
    fits = "s" * 58  # 60 characters quoted: shown whole
    with pytest.raises(manifest_module.UserError) as info:
        check({**good, "runs": [_entry(settings=fits)]}, "m")
    assert str(info.value) == f'm: runs[0].settings must be a table of settings, got "{fits}"'
    with pytest.raises(manifest_module.UserError) as info:
        check({**good, "runs": [_entry(settings=fits + "s")]}, "m")  # 61: cut to 57 and "..."
    assert str(info.value) == f'm: runs[0].settings must be a table of settings, got "{fits[:56]}...'


def test_a_finished_runs_folder_that_is_a_link_is_refused_and_the_summary_reads_only_real_run_folders(
    tmp_path, fails
) -> None:
    folder = tmp_path / "sweep"
    path = _manifest(folder, [_entry("a", status="done"), _entry("b", status="done"), _entry("c")])
    _run_folder(folder / "a", b'{"step": 0, "val_loss": 4.0}\n')
    _run_folder(tmp_path / "elsewhere", b'{"step": 0, "val_loss": 3.0}\n')
    (folder / "b").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    fails(["compare", str(folder)], f"tlm: error: {folder / 'b'} is a symbolic link: a sweep's runs are folders of")
    fails(["sweep", "--resume", str(folder)], f"tlm: error: {folder / 'b'} is a symbolic link: tlm sweep never trains")
    manifest = sweep.read_manifest(folder)
    assert [(s.name, s.best_val_loss) for s in sweep.summarize(folder, manifest)] == [("a", 4.0)]  # b: a link, c: none
    (folder / "b").unlink()
    (folder / ".lock").symlink_to(path)
    fails(["sweep", "--resume", str(folder)], f"{folder / '.lock'} is a symbolic link: tlm sweep never follows one")
    (folder / ".lock").unlink()
    for _ in range(2):  # the lock is given back when a sweep ends
        with sweep._locked(folder):
            pass


def test_a_run_resumes_with_its_own_train_toml_in_its_current_folder_and_the_changeable_planned_settings(
    tmp_path, monkeypatch
) -> None:
    import tlm_train
    from tlm_train import RunDir, TrainConfig

    folder = tmp_path / "sweep"
    _manifest(folder, [_entry("a"), _entry("b")], base={**BASE, "data": ["corpus.txt"]})
    # Run a's train.toml as the run wrote it before the sweep folder was moved here: its vocabulary the
    # tokenizer's 261 tokens, its own seed and folder.
    saved = TrainConfig(**{**BASE, "vocab_size": 261, "data": ["corpus.txt"], "out_dir": "/moved/sweep/a"})
    (folder / "a").mkdir()
    RunDir(folder / "a").write_config(saved)
    calls = []
    monkeypatch.setattr(tlm_train, "train", lambda config, resume, **kw: calls.append((config, resume)) or _Done())
    planned = sweep.Sweep(folder, sweep.read_manifest(folder), jobs=1, quiet=True)
    for name in ("a", "b"):
        entry = _entry(name, settings={"steps": 5, "seed": 7, "lr": 1e-4, "model.d_model": 64})
        assert sweep.train_run(planned.job(entry)) == {"status": "done", "stop": False}
    (resumed, resume), (fresh, new) = calls
    assert resume and not new
    assert resumed.out_dir == str(folder / "a") and fresh.out_dir == str(folder / "b")
    assert (resumed.steps, resumed.lr) == (5, 1e-4)  # what a resume may change: the plan's
    assert (resumed.vocab_size, resumed.seed, resumed.model) == (261, 0, saved.model)  # the rest: the run's own
    assert (fresh.steps, fresh.seed, fresh.vocab_size, fresh.model["d_model"]) == (5, 7, 32, 64)


class _Done:
    interrupted = False
    stop_requested = False
