"""Runs grouped into settings (the same settings apart from the seed), each setting's statistics against
the baseline, and the figure of a comparison: what ``tlm sweep``'s summary and ``tlm compare`` show.

A setting's final and best validation loss are given as mean, sample standard deviation and N over its
finished runs (done or unstable); its final loss is compared with the baseline's as a difference with a
95% interval (:mod:`tlm_experiments.stats`: paired by seed when both ran the same seeds, Welch's otherwise).
The baseline is the setting named ``baseline``, else the first.

The figure: validation loss by step (every run's every evaluation as a marker, and per setting of several
seeds the mean curve with a min–max band), by wall-clock time, and the final loss per setting (mean with
± sd error bars, each seed a dot). The loss axes are clipped to the range of the done runs (logarithmic
when that range spans more than a factor of 3), so that a run that blows up does not flatten the others: a
run that leaves the range is marked (▲) where it left it, a diverged one (×) at the step it diverged; an
interrupted run is drawn dashed and never marked as diverged.
The caption names the runs, their seeds and steps.
"""

import json
import math
import re
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any

from tlm_experiments.stats import Difference, Sample, describe, difference

_SEED = re.compile(r"(^|,)seed=[^,]*")
#: The loss axes turn logarithmic when the done runs' highest loss is above this multiple of their lowest.
LOG_ABOVE = 3.0

#: A finished run is ``unstable`` when some evaluation exceeded this multiple of its first (step 0) loss.
UNSTABLE_ABOVE = 1.5
#: How a run ended, as every table, JSON file and plot says it: ``done``; ``diverged`` (its loss stopped being
#: finite, at ``diverged_at``); ``unstable`` (finished, but some evaluation went above ``UNSTABLE_ABOVE`` × its
#: starting loss, first at ``unstable_at``); ``interrupted`` (stopped before its last step, resumable: not a
#: result); ``failed`` (an error, in ``message``).
STATUSES = ("done", "diverged", "unstable", "interrupted", "failed")


#: A matplotlib colour: a name, or the RGB(A) tuple a colormap gives.
Color = str | tuple[float, ...]


@dataclass
class RunSummary:
    """What one run reached; :meth:`to_dict` is its entry of ``summary.json``."""

    name: str
    path: str
    settings: dict[str, Any]  # what sets this run apart (a sweep's overrides, or what differs between runs)
    status: str  # one of STATUSES
    steps: int  # the last step trained
    planned_steps: int
    final_val_loss: float | None  # at the last step of a finished (done or unstable) run; None for any other
    best_val_loss: float | None
    tokens: int
    parameters: int
    wall_time_s: float | None
    tokens_per_s: float | None
    diverged: bool
    diverged_at: int | None = None
    seed: int | None = None
    unstable_at: int | None = None  # the first evaluation above UNSTABLE_ABOVE × the starting loss
    message: str | None = None  # why a failed run failed
    curve: list[tuple[int, float | None, float]] = field(default_factory=list, repr=False)  # (step, time_s, val)

    @property
    def finished(self) -> bool:
        """Whether the run reached its last step (done or unstable): only these have a final loss."""
        return self.status in ("done", "unstable")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("curve")
        return data


@dataclass
class Group:
    """The runs of one setting: the same settings apart from the seed."""

    label: str
    settings: dict[str, Any]
    runs: list[RunSummary] = field(default_factory=list)

    @property
    def seeds(self) -> list[int | None]:
        return [r.seed for r in self.runs]

    def finals(self) -> dict[Any, float]:
        """The final loss of each finished run, by seed (by position where seeds repeat or are unknown)."""
        done = [r for r in self.runs if r.final_val_loss is not None]
        keys: list[Any] = [r.seed for r in done]
        if len(set(keys)) < len(keys) or None in keys:
            keys = [("run", i) for i in range(len(done))]  # no pairing by seed possible
        return {k: float(r.final_val_loss) for k, r in zip(keys, done, strict=True)}  # type: ignore[arg-type]

    def bests(self) -> list[float]:
        return [r.best_val_loss for r in self.runs if r.finished and r.best_val_loss is not None]


def group_runs(summaries: list[RunSummary]) -> list[Group]:
    """The runs grouped by their settings apart from ``seed``, in the order each setting first appears."""
    groups: dict[str, Group] = {}
    for s in summaries:
        settings = {k: v for k, v in s.settings.items() if k != "seed"}
        key = json.dumps(settings, sort_keys=True, default=str)
        if key not in groups:
            groups[key] = Group(_label(s, settings), settings)
        groups[key].runs.append(s)
    for group in groups.values():  # a sweep's runs are named by setting: "baseline,seed=1" is "baseline"
        names = {_SEED.sub("", r.name).strip(",") for r in group.runs}
        if len(names) == 1 and (name := names.pop()):
            group.label = name
    labels = [g.label for g in groups.values()]
    for group in groups.values():
        if labels.count(group.label) > 1:
            group.label = ", ".join(f"{k}={setting_text(v)}" for k, v in group.settings.items()) or group.label
    return list(groups.values())


def _label(s: RunSummary, settings: dict[str, Any]) -> str:
    return ", ".join(f"{k.removeprefix('model.')}={setting_text(v)}" for k, v in settings.items()) or s.name


def setting_text(value: Any) -> str:
    """A setting's value as a table shows it: a float by ``%g``, a table as JSON."""
    return f"{value:g}" if isinstance(value, float) else json.dumps(value) if isinstance(value, dict) else str(value)


@dataclass
class SettingStats:
    """One setting's line of the statistics (``summary.json``'s ``settings``)."""

    label: str
    settings: dict[str, Any]
    seeds: list[int | None]
    statuses: dict[str, int]
    final: Sample
    best: Sample
    vs_baseline: Difference | None  # the final loss minus the baseline's; None for the baseline itself

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "settings": self.settings,
            "seeds": self.seeds,
            "statuses": self.statuses,
            "final_val_loss": self.final.to_dict(),
            "best_val_loss": self.best.to_dict(),
            "vs_baseline": None if self.vs_baseline is None else self.vs_baseline.to_dict(),
        }


def baseline_index(groups: list[Group], baseline: str = "baseline") -> int:
    """The setting labelled ``baseline``, else the first."""
    return next((i for i, g in enumerate(groups) if g.label == baseline), 0)


def statistics(groups: list[Group], *, baseline: str = "baseline") -> list[SettingStats]:
    """Each setting's mean, sd and N of final and best loss, and its final loss against the baseline's (the
    setting labelled ``baseline``, else the first)."""
    if not groups:
        return []
    reference = groups[baseline_index(groups, baseline)]
    base = reference.finals()
    out = []
    for group in groups:
        finals = group.finals()
        diff = None
        if group is not reference and finals and base:
            diff = difference(finals, base)
        out.append(SettingStats(group.label, group.settings, group.seeds, _statuses(group.runs),
                                describe(finals.values()), describe(group.bests()), diff))  # fmt: skip
    return out


def _mean_sd(sample: Sample) -> str:
    if sample.mean is None:
        return "–"
    return f"{sample.mean:.4f} ± {sample.sd:.4f} ({sample.n})" if sample.sd is not None else f"{sample.mean:.4f} (1)"


def stats_markdown(stats: list[SettingStats]) -> str:
    """The statistics as a Markdown table, one row per setting, with a line saying what the columns are."""
    if not stats:
        return ""
    head = ["setting", "seeds", "runs", "final val loss, mean ± sd (N)", "best val loss, mean ± sd (N)",
            "final − baseline [95% interval]", "beyond noise?"]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for st in stats:
        seeds = ", ".join("?" if s is None else str(s) for s in st.seeds)
        runs = ", ".join(f"{n} {status}" for status, n in st.statuses.items())
        d = st.vs_baseline
        if d is None:
            versus, beyond = ("baseline", "–") if st.final.n else ("–", "–")
        elif d.low is None or d.high is None:
            versus, beyond = f"{d.estimate:+.4f} (no interval: one seed)", "–"
        else:
            versus = f"{d.estimate:+.4f} [{d.low:+.4f}, {d.high:+.4f}] ({d.method})"
            beyond = "yes" if d.excludes_zero else "no"
        rows.append("| " + " | ".join([st.label, seeds, runs, _mean_sd(st.final), _mean_sd(st.best), versus,
                                       beyond]) + " |")  # fmt: skip
    note = (
        "\nFinished runs only (done or unstable); the interval is Student's t at 95%, paired by seed where both "
        "settings ran the same seeds, Welch's otherwise; *beyond noise* when it excludes zero.\n"
    )
    return "\n".join(rows) + "\n" + note


# ------------------------------------------------------------------------------------------ the figure


def loss_range(summaries: list[RunSummary]) -> tuple[float, float] | None:
    """The validation losses of the done runs (else of every run), lowest and highest: the loss axes show these."""
    for chosen in (
        [s for s in summaries if s.status == "done"],
        [s for s in summaries if s.finished],
        summaries,
    ):
        values = [v for s in chosen for _, _, v in s.curve]
        if values:
            return min(values), max(values)
    return None


def _limits(span: tuple[float, float], *, log: bool = False) -> tuple[float, float]:
    low, high = span
    if log:
        return low / 1.05, high * 1.05
    pad = max(0.05 * (high - low), 0.02 * max(abs(high), 1e-3))
    return low - pad, high + pad


def caption(summaries: list[RunSummary], groups: list[Group]) -> str:
    """What a figure shows: each setting's runs with their seeds, steps and how they ended."""
    parts = []
    for g in groups:
        seeds = ",".join("?" if s is None else str(s) for s in g.seeds)
        steps = sorted({r.planned_steps for r in g.runs})
        ended = ", ".join(f"{n} {status}" for status, n in _statuses(g.runs).items())
        parts.append(f"{g.label}: seed{'s' if len(g.runs) > 1 else ''} {seeds}, "
                     f"{'/'.join(map(str, steps))} steps ({ended})")  # fmt: skip
    text = f"{len(summaries)} runs. " + "; ".join(parts) + ". "
    text += "× diverged (at its step); ▲ left the range of the done runs (at the step it left); dashed: interrupted."
    return "\n".join(textwrap.wrap(text, 190))


def _statuses(runs: list[RunSummary]) -> dict[str, int]:
    return {s: n for s in STATUSES if (n := sum(r.status == s for r in runs))}


def figure(summaries: list[RunSummary], *, title: str | None = None) -> Any:
    """The comparison's matplotlib Figure: loss by step, by wall-clock time, final loss per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group_runs(summaries)
    span = loss_range(summaries)
    log = bool(span and span[1] > LOG_ABOVE * span[0] > 0)  # e.g. a run without a norm that starts at 29 nats
    limits = _limits(span, log=log) if span else None
    fig, (by_step, by_time, final) = plt.subplots(1, 3, figsize=(16, 4.8), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, group in enumerate(groups):
        color = colors[i % len(colors)]
        _curves(by_step, group, color, limits, x="step")
        _curves(by_time, group, color, limits, x="time")
        _band(by_step, group, color)
    for ax, label in ((by_step, "step"), (by_time, "wall-clock time (s)")):
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
        if limits:
            if log:
                ax.set_yscale("log")
            ax.set_ylim(*limits)
    if by_step.get_legend_handles_labels()[0]:
        by_step.legend(fontsize=7)
    by_step.set_title("validation loss by step (every evaluation; mean and min–max band per setting)", fontsize=9)
    by_time.set_title("validation loss by wall-clock time", fontsize=9)
    _final_panel(final, groups)
    if title:
        fig.suptitle(title)
    fig.supxlabel(caption(summaries, groups), fontsize=7)
    return fig


def _curves(ax: Any, group: Group, color: Color, limits: tuple[float, float] | None, *, x: str) -> None:
    labelled = False
    for s in group.runs:
        if not s.curve:
            continue
        xs = [step if x == "step" else t for step, t, _ in s.curve]
        if any(v is None for v in xs):
            continue  # a curve without times (an old run) has no place on the time axis
        ys = [v for _, _, v in s.curve]
        style = "--" if s.status == "interrupted" else "-"
        label = None
        if x == "step" and not labelled:
            label = group.label + (f" ({len(group.runs)} seeds)" if len(group.runs) > 1 else "")
            labelled = True
        ax.plot(xs, ys, style, marker="o", markersize=3, linewidth=0.8, alpha=0.6, color=color, label=label)
        if limits is None:
            continue
        top = limits[1]
        left = next((i for i, v in enumerate(ys) if v > top), None)
        if left is not None:  # the run left the range: marked at the evaluation that did
            ax.plot(xs[left], top, "^", color=color, markersize=8, clip_on=False, gid="left-range")
        if s.status == "diverged":
            at = s.diverged_at if x == "step" else _time_at(s)
            if at is not None:
                ax.plot(at, top, "x", color="red", markersize=9, markeredgewidth=2, clip_on=False, gid="diverged")


def _time_at(s: RunSummary) -> float | None:
    times = [t for _, t, _ in s.curve if t is not None]
    return times[-1] if times else None


def _band(ax: Any, group: Group, color: Color) -> None:
    """The mean curve and its min–max band over the setting's finished runs, where they share their steps."""
    runs = [r for r in group.runs if r.finished and r.curve]
    if len(runs) < 2 or len({tuple(step for step, _, _ in r.curve) for r in runs}) != 1:
        return
    steps = [step for step, _, _ in runs[0].curve]
    columns = list(zip(*([v for _, _, v in r.curve] for r in runs), strict=True))
    mean = [math.fsum(c) / len(c) for c in columns]
    ax.plot(steps, mean, "-", color=color, linewidth=2.2, gid="mean")
    ax.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=color, alpha=0.18, gid="band")


def _final_panel(ax: Any, groups: list[Group]) -> None:
    """Each setting's final loss: the mean with ± sd error bars and every seed a dot, on an axis that the done
    runs' final losses set (not from zero); a final loss above it a ▲ on the top edge, an unstable run a ring
    around its dot, a setting with a diverged run a red × on the top edge."""
    key = _swept_key(groups)
    xs = [g.settings[key] for g in groups] if key else list(range(len(groups)))
    done = [r.final_val_loss for g in groups for r in g.runs if r.status == "done" and r.final_val_loss is not None]
    finals_all = [f for g in groups for f in g.finals().values()]
    for g in groups:  # a setting whose runs all ended done widens the range by its error bar
        sample = describe(g.finals().values())
        if sample.mean is not None and sample.sd is not None and all(r.status == "done" for r in g.runs):
            done += [sample.mean - sample.sd, sample.mean + sample.sd]
    low, high = _limits((min(done or finals_all), max(done or finals_all))) if done or finals_all else (0.0, 1.0)
    for x, g in zip(xs, groups, strict=True):
        finals = list(g.finals().values())
        sample = describe(finals)
        if sample.mean is not None:
            ax.errorbar([x], [sample.mean], yerr=[[sample.sd or 0.0], [sample.sd or 0.0]], fmt="o", color="black",
                        markersize=6, capsize=5)  # fmt: skip
            ax.plot([x] * len(finals), finals, ".", color="tab:blue", alpha=0.7, gid="seed")
        if any(f > high for f in finals):
            ax.plot(x, high, "^", color="tab:orange", markersize=9, clip_on=False, gid="left-range")
        for r in g.runs:
            if r.status == "unstable" and r.final_val_loss is not None and r.final_val_loss <= high:
                ax.plot(x, r.final_val_loss, "o", markerfacecolor="none", color="tab:orange", markersize=10,
                        gid="unstable")  # fmt: skip
        if any(r.status == "diverged" for r in g.runs):
            ax.plot(x, high, "x", color="red", markersize=10, markeredgewidth=2, clip_on=False, gid="diverged")
    ax.set_ylim(low, high)
    if key:
        ax.set_xscale("log")
        ax.set_xlabel(key)
    else:
        ax.set_xticks(xs, [g.label for g in groups], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("final validation loss")
    ax.set_title("final validation loss" + (f" by {key}" if key else " by setting") + " (mean ± sd, each seed •)",
                 fontsize=9)  # fmt: skip
    ax.grid(alpha=0.3)


def _swept_key(groups: list[Group]) -> str | None:
    """The one setting that differs between the settings and is a positive number in each, else None."""
    keys = {k for g in groups for k in g.settings}
    if len(keys) != 1 or len(groups) < 2:
        return None
    (key,) = keys
    values = [g.settings.get(key) for g in groups]
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in values)
    return key if ok else None
