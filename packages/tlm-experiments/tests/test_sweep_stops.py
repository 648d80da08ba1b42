"""A sweep's bounds and stops: ``--seeds`` is counted in the plan's size before any run is made, and a stop
signal that comes too late to stop a run (during its last step) still stops the sweep after that run."""

import json
import os
import signal

import numpy as np
import pytest

from tlm_core.cli import UserError
from tlm_experiments import sweep
from tlm_experiments.sweep import SweepOptions

SETTINGS = {"vocab_size": 32, "batch_size": 4, "eval_batches": 1, "peak_flops": 1e9, "warmup_steps": 0,
            "sample_tokens": 0, "eval_interval": 10, "checkpoint_interval": 10, "steps": 2,
            "context_length": 16, "d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32}  # fmt: skip


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"grid": ["lr=1,2"], "seeds": 600}, "--grid: 2 x 600 seeds = 1,200 runs, more than --max-runs 1,000"),
        ({"grid": ["lr=1,2"], "seeds": 3, "max_runs": 5}, "--grid: 2 x 3 seeds = 6 runs, more than --max-runs"),
        ({"grid": ["lr=1"], "seeds": 10**9}, "--grid: 1 x 1000000000 seeds = 1,000,000,000 runs, more than"),
        ({"grid": ["lr=1"], "seeds": 2, "max_runs": 1}, "--grid: 1 x 2 seeds = 2 runs, more than --max-runs"),
        # One seed is no factor: the grid's sizes alone.
        ({"grid": ["lr=1,2,3", "weight_decay=0,1"], "seeds": 1, "max_runs": 5},
         "--grid: 3 x 2 = 6 runs, more than --max-runs 5;"),
    ],
)  # fmt: skip
def test_seeds_count_before_the_max_runs_check(tmp_path, options, message):
    with pytest.raises(UserError, match=f"^{message}"):
        sweep.plan(SweepOptions(out_dir=str(tmp_path / "s"), **options), tmp_path / "s")
    assert len(sweep.plan(SweepOptions(out_dir="x", grid=["lr=1,2"], seeds=3), tmp_path)["runs"]) == 6


def test_a_runs_file_times_its_seeds_is_bounded_too(tmp_path):
    runs = tmp_path / "runs.toml"
    runs.write_text("[runs.a]\nlr = 1e-3\n[runs.b]\nlr = 2e-3\n")
    with pytest.raises(UserError, match=r"^--runs \S+: 2 x 3 seeds = 6 runs, more than --max-runs 5$"):
        sweep.plan(SweepOptions(out_dir="x", runs=str(runs), seeds=3, max_runs=5), tmp_path)


def test_a_stop_during_a_runs_last_step_stops_the_sweep_after_it(tmp_path, monkeypatch):
    from tlm_train.recipe import Recipe

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.tile(np.random.default_rng(0).integers(0, 32, 50), 20).astype(np.uint16))
    saving = Recipe.maybe_checkpoint

    def checkpoint_then_signal(self, step, *args, **kwargs):
        saving(self, step, *args, **kwargs)
        if step == self.steps:  # Ctrl-C while the last step's checkpoint is written: too late to stop this run
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Recipe, "maybe_checkpoint", checkpoint_then_signal)
    sets = [f"{k}={v}" for k, v in {**SETTINGS, "data": tokens}.items()]
    args = SweepOptions(out_dir=str(tmp_path / "sweep"), grid=["lr=1e-3,2e-3"], set=sets, jobs=1, quiet=True)
    assert sweep.run(args) == 130
    runs = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["runs"]
    assert [r["status"] for r in runs] == ["done", "pending"]  # the first finished; the second never started
    assert not (tmp_path / "sweep" / "lr=2e-3").exists()


def test_a_sweep_folder_that_overlaps_what_a_run_reads_is_refused_before_anything_is_written(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for out in (base / "sweeps", base):
        args = SweepOptions(out_dir=str(out), grid=["lr=1e-3,2e-3"], set=[f"init_from={base}"])
        with pytest.raises(ValueError, match=rf"^run lr=1e-3: --out-dir {out} (lies inside|is) --init-from {base}"):
            sweep.run(args)
    assert sorted(base.iterdir()) == []


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"grid": "lr=1,2"}, TypeError, r"^SweepOptions.grid must be a list of 'KEY=...' strings, got 'lr=1,2'$"),
        ({"set": ["steps=2", 3]}, TypeError, r"^SweepOptions.set must be a list of 'KEY=...' strings"),
        ({"seeds": 0}, ValueError, r"^SweepOptions.seeds must be positive, got 0$"),
        ({"jobs": 1.5}, TypeError, r"^SweepOptions.jobs must be an int, got float"),
        ({"unstable_above": 0.0}, ValueError, r"^SweepOptions.unstable_above must be a finite number > 0"),
        ({"quiet": 1}, TypeError, r"^SweepOptions.quiet must be a bool"),
        ({"launcher": "cloud"}, ValueError, r"^SweepOptions.launcher must be one of \['local', 'slurm'\]"),
    ],
)  # fmt: skip
def test_sweep_options_refuse_what_a_notebook_could_pass_wrong(fields, error, message):
    """The library's own boundary: a value the command line could never produce is refused when the options are
    made, naming the field, before any folder is touched."""
    with pytest.raises(error, match=message):
        SweepOptions(out_dir="x", **fields)
    assert SweepOptions(out_dir="x", grid=("lr=1,2",), seeds=2, jobs=1, quiet=True).grid == ("lr=1,2",)
