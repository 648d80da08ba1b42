"""``tlm compare``: runs side by side, from their run folders (or every run of a sweep folder).

Each run is read from what ``tlm train`` left in its folder: ``train.toml`` (the settings and the model)
and ``metrics.jsonl`` (every record with its step and wall-clock seconds). The table gives per run the
settings that differ between the runs, the final and best validation loss, the tokens trained on, the
wall time and tokens per second, and whether it diverged (its loss stopped being finite); ``--out
FILE.png`` draws validation loss against step and against wall-clock time, one curve per run, and the
final loss against the one numeric setting that differs (a log axis, diverged runs marked).

    tlm compare runs/a runs/b --out compare.png
    tlm compare sweeps/lr --json
"""

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tlm_command.args import UserError, add_command
from tlm_command.manifest import MANIFEST, read_manifest

#: Summary fields that measure the machine, not the run: a resumed run's differ from an uninterrupted one's.
TIMING_FIELDS = ("wall_time_s", "tokens_per_s")


@dataclass
class RunSummary:
    """What one run reached; :meth:`to_dict` is its entry of ``summary.json``."""

    name: str
    path: str
    settings: dict[str, Any]  # what sets this run apart (a sweep's overrides, or what differs between runs)
    status: str  # done, diverged, stopped (interrupted or not yet at its last step), failed, pending
    steps: int  # the last step trained
    planned_steps: int
    final_val_loss: float | None  # at the last step of a finished run; None for any other
    best_val_loss: float | None
    tokens: int
    parameters: int
    wall_time_s: float | None
    tokens_per_s: float | None
    diverged: bool
    diverged_at: int | None = None
    curve: list[tuple[int, float | None, float]] = field(default_factory=list, repr=False)  # (step, time_s, val)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("curve")
        return data


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a last line cut short by a kill is dropped. A record that is not an
    object with an integer ``step`` >= 0 (a file edited by hand, or not tlm's) is one line naming the file."""
    if not path.is_file():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            what = f"step {json.dumps(step)}" if isinstance(record, dict) and "step" in record else "no step"
            if not isinstance(record, dict):
                what = f"a {type(record).__name__}, not an object"
            raise UserError(f"{path}: line {number}: expected a record with an integer step >= 0, got {what}")
        records.append(record)
    return records


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def summarize(path: Path, *, name: str | None = None, settings: dict[str, Any] | None = None,
              status: str | None = None) -> RunSummary:  # fmt: skip
    """A run folder's :class:`RunSummary`. ``status`` (a sweep's record of how the run ended) wins over
    what the folder says; without it, the run is done when its metrics reach its last step."""
    from tlm_model.accounting import count_parameters
    from tlm_train import RunDir

    run = RunDir(path)
    config = run.read_config()
    records = read_metrics(run.metrics_path)
    curve = [(r["step"], r.get("time_s"), r["val_loss"]) for r in records if _finite(r.get("val_loss"))]
    trained = [r for r in records if "train_loss" in r or "val_loss" in r]
    diverged_events = [r for r in records if r.get("event") == "diverged"]
    steps = max((int(r["step"]) for r in trained), default=0)
    planned = config.total_steps()
    diverged = bool(diverged_events) or status == "diverged"
    if status is None:
        status = "diverged" if diverged else "done" if steps >= planned else "stopped"
    times = [r["time_s"] for r in records if _finite(r.get("time_s"))]
    tokens = max((int(r["tokens"]) for r in records if _finite(r.get("tokens"))), default=0)
    wall = times[-1] if times else None
    final = curve[-1][2] if status == "done" and curve and curve[-1][0] == steps else None
    return RunSummary(
        name=name or run.path.name,
        path=str(run.path),
        settings=settings if settings is not None else {},
        status=status,
        steps=steps,
        planned_steps=planned,
        final_val_loss=final,
        best_val_loss=min((v for _, _, v in curve), default=None),
        tokens=tokens,
        parameters=sum(count_parameters(config.model_config()).values()),
        wall_time_s=wall,
        tokens_per_s=tokens / wall if wall else None,
        diverged=diverged,
        diverged_at=int(diverged_events[-1]["step"]) if diverged_events else None,
        curve=curve,
    )


def _flat_settings(path: Path) -> dict[str, Any]:
    """A run's train.toml as one level (``model.d_model``), without where it was written."""
    from tlm_train import RunDir

    config = RunDir(path).read_config().to_dict()
    flat = {k: v for k, v in config.items() if k not in ("model", "out_dir")}
    flat.update({f"model.{k}": v for k, v in config["model"].items()})
    return flat


def differing(paths: list[Path]) -> list[dict[str, Any]]:
    """Per run, the settings whose values are not the same in every run."""
    flats = [_flat_settings(p) for p in paths]
    keys = sorted({k for f in flats for k in f})
    varied = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1]
    return [{k: f.get(k) for k in varied} for f in flats]


def swept_key(summaries: list[RunSummary]) -> str | None:
    """The one setting that differs between the runs and is a positive number in each, else None."""
    keys = {k for s in summaries for k in s.settings}
    numeric = [
        k for k in sorted(keys)
        if all(_finite(s.settings.get(k)) and not isinstance(s.settings.get(k), bool) and s.settings[k] > 0
               for s in summaries)
    ]  # fmt: skip
    return numeric[0] if len(keys) == 1 and numeric else None


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3g}"
    return str(value)


def markdown(summaries: list[RunSummary]) -> str:
    """The comparison as a Markdown table, one row per run."""
    head = ["run", "settings", "status", "steps", "parameters", "final val loss", "best val loss", "tokens",
            "wall time (s)", "tokens/s"]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        settings = ", ".join(f"{k}={_setting(v)}" for k, v in s.settings.items()) or "–"
        status = f"diverged at step {s.diverged_at}" if s.diverged and s.diverged_at is not None else s.status
        cells = [s.name, settings, status, f"{s.steps}/{s.planned_steps}", f"{s.parameters:,}",
                 _fmt(s.final_val_loss), _fmt(s.best_val_loss), f"{s.tokens:,}", _fmt(s.wall_time_s, 1),
                 _fmt(s.tokens_per_s, 0)]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _setting(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else json.dumps(value) if isinstance(value, dict) else str(value)


def plot(summaries: list[RunSummary], out: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Validation loss against step and against wall-clock time (one curve per run), and the final loss
    against the swept setting (log axis; diverged runs marked) or per run, in one PNG written whole."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'tlm-command[plot]'") from None
    from tlm_core.atomic import atomic_write

    fig, (by_step, by_time, final) = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained")
    for s in summaries:
        if not s.curve:
            continue
        steps, times, losses = zip(*s.curve, strict=True)
        (line,) = by_step.plot(steps, losses, "o-", markersize=3, label=s.name)
        if all(t is not None for t in times):
            by_time.plot(times, losses, "o-", markersize=3, color=line.get_color(), label=s.name)
        if s.diverged:
            by_step.plot(steps[-1], losses[-1], "x", color="red", markersize=9, markeredgewidth=2)
    for ax, label in ((by_step, "step"), (by_time, "wall-clock time (s)")):
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=7)
    by_step.set_title("validation loss by step (× diverged)", fontsize=10)
    by_time.set_title("validation loss by wall-clock time", fontsize=10)
    _final_panel(final, summaries)
    if title:
        fig.suptitle(title)
    out = Path(out)
    atomic_write(out, lambda file: fig.savefig(file, format="png", dpi=100))
    plt.close(fig)
    return out


def _final_panel(ax: Any, summaries: list[RunSummary]) -> None:
    key = swept_key(summaries)
    finished = [s.final_val_loss for s in summaries if s.final_val_loss is not None]
    top = max(finished, default=1.0)
    marked = False
    if key is not None:
        done = sorted((s.settings[key], s.final_val_loss) for s in summaries if s.final_val_loss is not None)
        if done:
            ax.plot(*zip(*done, strict=True), "o-")
        for s in summaries:
            if s.diverged:
                ax.plot(s.settings[key], top * 1.05, "x", color="red", markersize=10, markeredgewidth=2,
                        label=None if marked else "diverged")  # fmt: skip
                marked = True
        ax.set_xscale("log")
        ax.set_xlabel(key)
    else:
        names = [s.name for s in summaries]
        ax.bar(names, [s.final_val_loss or 0.0 for s in summaries])
        for i, s in enumerate(summaries):
            if s.final_val_loss is None:
                ax.plot(i, top * 1.05, "x", color="red", markersize=10, markeredgewidth=2,
                        label=None if marked else "diverged or unfinished")  # fmt: skip
                marked = True
        if finished:
            low = min(finished)
            ax.set_ylim(low - 0.1 * (top - low) - 0.05, top * 1.1)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    if marked:
        ax.legend(fontsize=8)
    ax.set_ylabel("final validation loss")
    ax.set_title("final validation loss" + (f" by {key}" if key else " by run"), fontsize=10)
    ax.grid(alpha=0.3)


def sweep_runs(folder: Path) -> list[tuple[str, Path, dict[str, Any], str]]:
    """(name, folder, settings, status) of each run a sweep's manifest lists."""
    manifest = read_manifest(folder)
    for run in manifest["runs"]:
        if (folder / run["name"]).is_symlink():
            raise UserError(f"{folder / run['name']} is a symbolic link: a sweep's runs are folders of their own")
    return [(r["name"], folder / r["name"], r["settings"], r["status"]) for r in manifest["runs"]]


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "compare",
        "put runs (or a sweep's runs) side by side: a table, and validation loss by step and by time",
        __doc__,
    )
    parser.add_argument("paths", nargs="+", metavar="RUN_OR_SWEEP", help="run folders, or sweep folders")
    parser.add_argument("--out", metavar="FILE.png", help="draw the comparison into this PNG")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    parser.set_defaults(run=run)


def collect(paths: list[str]) -> list[RunSummary]:
    """The summaries of the named runs and of every run of the named sweeps, in order."""
    summaries: list[RunSummary] = []
    plain: list[Path] = []
    for given in paths:
        path = Path(given)
        if (path / MANIFEST).is_file():
            for name, folder, settings, status in sweep_runs(path):
                if (folder / "train.toml").is_file():
                    summaries.append(summarize(folder, name=name, settings=settings, status=_status(status)))
        elif (path / "train.toml").is_file():
            plain.append(path)
        else:
            raise UserError(f"{given}: neither a run folder (train.toml) nor a sweep folder ({MANIFEST})")
    if plain:
        for path, settings in zip(plain, differing(plain) if len(plain) > 1 else [{}], strict=True):
            summaries.append(summarize(path, settings=settings))
    names = [s.name for s in summaries]
    for s in summaries:  # runs of different folders may share a name: name them by their path instead
        if names.count(s.name) > 1:
            s.name = s.path
    return summaries


def _status(status: str) -> str | None:
    # A sweep knows which of its runs diverged or failed; whether the others finished, the folder says.
    return status if status in ("diverged", "failed") else None


def run(args: argparse.Namespace) -> int:
    summaries = collect(args.paths)
    if not summaries:
        raise UserError("no run to compare: the sweep folders hold no run that has started")
    if args.out is not None:
        plot(summaries, args.out)
    if args.json:
        print(json.dumps([s.to_dict() for s in summaries], indent=2, allow_nan=False))
    else:
        sys.stdout.write(markdown(summaries))
    return 0
