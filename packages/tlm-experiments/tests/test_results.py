"""The comparison figure read through matplotlib's objects (axes limits, scales, artists), not pixels: loss
axes clipped to the done runs, each run that left them marked where it did, a diverged run at its step, an
interrupted run never drawn as diverged, the mean and band of a setting's seeds, error bars on an axis that
starts where the data does, and a caption naming runs, seeds and steps."""

import math

import pytest

from tlm_experiments.compare import RunSummary
from tlm_experiments.results import figure, group_runs

pytest.importorskip("matplotlib")


def _summary(name, status, values, *, seed=0, steps=(0, 10, 20, 30), diverged_at=None, unstable_at=None, **settings):
    curve = [(step, step / 10, v) for step, v in zip(steps, values, strict=False)]
    finished = status in ("done", "unstable")
    return RunSummary(
        name=name, path=name, settings={**settings, "seed": seed}, status=status, steps=curve[-1][0],
        planned_steps=30, final_val_loss=values[-1] if finished else None, best_val_loss=min(values), tokens=0,
        parameters=1, wall_time_s=3.0, tokens_per_s=None, diverged=status == "diverged", diverged_at=diverged_at,
        seed=seed, unstable_at=unstable_at, curve=curve,
    )  # fmt: skip


def _marks(ax, gid):
    return [(line.get_xdata()[0], line.get_ydata()[0]) for line in ax.get_lines() if line.get_gid() == gid]


@pytest.fixture
def runs():
    return [
        *(_summary(f"lr=0.01,seed={k}", "done", [6.2, 4.5 + k / 10, 3.6 + k / 10, 3.2 + k / 10], seed=k, lr=0.01)
          for k in range(3)),
        _summary("lr=0.1,seed=0", "unstable", [6.2, 92.0, 8.0, 3.45], lr=0.1, unstable_at=10),
        _summary("lr=0.3,seed=0", "unstable", [6.2, 92.0, 80.0, 40.0], lr=0.3, unstable_at=10),
        _summary("lr=1,seed=0", "diverged", [6.2, 5.0], lr=1.0, diverged_at=17),
        _summary("lr=0.001,seed=0", "interrupted", [6.2, 5.9], lr=0.001),
    ]  # fmt: skip


def test_the_loss_axes_hold_the_done_runs_and_mark_where_the_others_left(runs) -> None:
    import matplotlib.pyplot as plt

    fig = figure(runs, title="t")
    by_step, by_time, _ = fig.axes
    low, high = by_step.get_ylim()
    assert by_step.get_yscale() == "linear" and by_time.get_ylim() == (low, high)
    assert 3.0 < low < 3.2 and 6.2 < high < 6.5  # the done runs' 3.2 .. 6.2, not the unstable run's 92
    # The unstable run left the range at step 10 (its 92): marked there, on the top edge; the diverged one at the
    # step its loss stopped being finite (17), never at step 0 or at its last evaluation.
    assert _marks(by_step, "left-range") == [(10, high), (10, high)]
    assert _marks(by_step, "diverged") == [(17, high)]
    interrupted = [line for line in by_step.get_lines() if line.get_label().startswith("lr=0.001")]
    assert len(interrupted) == 1 and interrupted[0].get_linestyle() == "--"
    assert interrupted[0].get_xdata().tolist() == [0, 10]  # every evaluation drawn, each one a marker
    assert interrupted[0].get_marker() == "o"
    plt.close(fig)


def test_the_loss_axes_turn_logarithmic_when_the_done_runs_span_more_than_a_factor_of_three(runs) -> None:
    import matplotlib.pyplot as plt

    no_norm = _summary("no-norm,seed=0", "done", [29.2, 6.5, 4.0, 3.3], **{"model.norm_placement": "none"})
    fig = figure([*runs, no_norm])
    by_step, by_time, _ = fig.axes
    assert (by_step.get_yscale(), by_time.get_yscale()) == ("log", "log")
    low, high = by_step.get_ylim()
    assert 3.0 < low < 3.2 and 29.2 < high < 31  # 3.2 .. 29.2, the done runs' whole range
    plt.close(fig)


def test_a_setting_of_several_seeds_has_its_mean_curve_and_min_max_band(runs) -> None:
    import matplotlib.pyplot as plt

    fig = figure(runs)
    by_step = fig.axes[0]
    (mean,) = [line for line in by_step.get_lines() if line.get_gid() == "mean"]  # one setting has 3 seeds
    assert mean.get_xdata().tolist() == [0, 10, 20, 30]
    assert mean.get_ydata().tolist() == pytest.approx([6.2, 4.6, 3.7, 3.3])
    (band,) = [c for c in by_step.collections if c.get_gid() == "band"]
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == pytest.approx(3.2) and max(ys) == pytest.approx(6.2)
    assert by_step.get_legend().get_texts()[0].get_text() == "lr=0.01 (3 seeds)"
    plt.close(fig)


def test_the_final_losses_are_points_with_error_bars_on_an_axis_the_data_sets(runs) -> None:
    import matplotlib.pyplot as plt

    fig = figure(runs)
    final = fig.axes[2]
    assert final.get_xscale() == "log" and final.get_xlabel() == "lr"
    finals = [3.2, 3.3, 3.4]
    sd = math.sqrt(sum((f - 3.3) ** 2 for f in finals) / 2)
    bar = final.containers[0]  # lr=0.01's errorbar: its mean, and ± sd as the bar
    assert bar.lines[0].get_xdata().tolist() == [0.01] and bar.lines[0].get_ydata() == pytest.approx([3.3])
    segment = bar.lines[2][0].get_segments()[0]
    assert segment[0][1] == pytest.approx(3.3 - sd) and segment[1][1] == pytest.approx(3.3 + sd)
    low, high = final.get_ylim()
    # The axis is the done runs' (3.2 .. 3.4, with the error bar), not from zero and not up to the unstable 40.
    assert 3.1 < low < 3.3 - sd and 3.3 + sd < high < 3.5
    assert _marks(final, "left-range") == [(0.3, high)]  # the unstable run's 40, on the top edge
    assert _marks(final, "unstable") == [(0.1, 3.45)]  # finished unstable inside the range: a ring on its dot
    assert _marks(final, "diverged") == [(1.0, high)]
    assert [c.lines[0].get_xdata()[0] for c in final.containers] == [0.01, 0.1, 0.3]  # interrupted: not a result
    plt.close(fig)


def test_the_caption_names_every_setting_its_seeds_steps_and_endings(runs) -> None:
    import matplotlib.pyplot as plt

    fig = figure(runs)
    text = fig.get_supxlabel().replace("\n", " ")
    assert text.startswith("7 runs. lr=0.01: seeds 0,1,2, 30 steps (3 done); lr=0.1: seed 0, 30 steps (1 unstable)")
    assert "lr=1: seed 0, 30 steps (1 diverged); lr=0.001: seed 0, 30 steps (1 interrupted)." in text
    plt.close(fig)


def test_runs_group_by_their_settings_apart_from_the_seed() -> None:
    runs = [_summary(f"{name},seed={k}", "done", [6.0, 4.0], seed=k, **settings)
            for name, settings in (("baseline", {}), ("post-norm", {"model.norm_placement": "post"}))
            for k in (0, 1)]  # fmt: skip
    groups = group_runs(runs)
    assert [(g.label, g.seeds, g.settings) for g in groups] == [
        ("baseline", [0, 1], {}),
        ("post-norm", [0, 1], {"model.norm_placement": "post"}),
    ]
