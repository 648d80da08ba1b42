"""tlm_experiments.compare.collect over a sweep folder (its manifest's runs, in order, each with the status the
sweep recorded where it diverged or failed), and the unstable threshold, which is measured from a run's first
evaluation (the starting loss), not its last. Expected values are counted from the records written here."""

from tlm_experiments.compare import collect, summarize
from tlm_experiments.manifest import FORMAT, write_manifest

TINY = {"context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64}
FINISHED = [{"step": 0, "val_loss": 4.0, "time_s": 0.5}, {"step": 4, "train_loss": 3.3, "val_loss": 3.2}]


def test_a_sweep_gives_its_started_runs_in_order_with_the_endings_it_recorded(hand_run, tmp_path):
    sweep = tmp_path / "sweep"
    config = hand_run(sweep / "lr=1e-3", FINISHED)
    hand_run(sweep / "lr=3e-3", FINISHED)  # its records say finished; the sweep saw it diverge
    runs = [
        {"name": "lr=1e-3", "settings": {"lr": 1e-3}, "status": "done"},
        {"name": "lr=2e-3", "settings": {"lr": 2e-3}, "status": "failed", "message": "out of memory"},  # no folder
        {"name": "lr=3e-3", "settings": {"lr": 3e-3}, "status": "diverged", "message": "loss is nan"},
    ]
    base = {k: v for k, v in config.to_dict().items() if k != "out_dir"}
    write_manifest(sweep, {"format": FORMAT, "base": base, "runs": runs})
    summaries = collect([str(sweep)])
    assert [(s.name, s.status, s.settings) for s in summaries] == [("lr=1e-3", "done", {"lr": 1e-3}),
                                                                   ("lr=3e-3", "diverged", {"lr": 3e-3})]  # fmt: skip
    assert [s.final_val_loss for s in summaries] == [3.2, None]


def test_a_run_is_unstable_when_an_evaluation_rises_past_the_bound_times_its_first(hand_run, tmp_path):
    # 4.0 at the start: the bound is 1.5 x 4.0 = 6.0. A bump to 5.0 stays under it (though above 1.5 x the last
    # loss, 2.0); one to 6.5 does not.
    for name, bump in (("bump", 5.0), ("spike", 6.5)):
        records = [{"step": 0, "val_loss": 4.0}, {"step": 2, "val_loss": bump}, {"step": 4, "val_loss": 2.0}]
        hand_run(tmp_path / name, records)
    bump, spike = summarize(tmp_path / "bump"), summarize(tmp_path / "spike")
    assert (bump.status, bump.unstable_at) == ("done", None)
    assert (spike.status, spike.unstable_at) == ("unstable", 2)
