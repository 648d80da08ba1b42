"""``tlm compare``: runs side by side, from their run folders (or every run of a sweep folder).

Each run is read from what ``tlm train`` left in its folder: ``train.toml`` (the settings and the model)
and ``metrics.jsonl`` (every record with its step and wall-clock seconds). The table gives per run the
settings that differ between the runs, how it ended (done, diverged at step S, unstable, interrupted,
failed), the final and best validation loss, the tokens trained on, the wall time and tokens per second;
a second table gives per setting (runs alike but for the seed) the mean, sd and N of the final and best
loss and the difference from the baseline with a 95% interval. ``--out FILE.png`` draws the loss by step
and by wall-clock time and the final loss per setting (:mod:`tlm_experiments.results`).

    tlm compare runs/a runs/b --out compare.png
    tlm compare sweeps/lr --json
"""

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tlm_core.atomic import check_input, read_input
from tlm_core.cli import UserError
from tlm_experiments.manifest import MANIFEST, read_manifest
from tlm_experiments.results import STATUSES, UNSTABLE_ABOVE, RunSummary, setting_text

__all__ = ["BITS_PER_BYTE", "NATS", "STATUSES", "UNSTABLE_ABOVE", "RunData", "RunSummary", "collect", "full_markdown",
           "harmonize", "markdown", "plot", "report", "run_data", "status_text", "summarize"]  # fmt: skip

#: Summary fields that measure the machine, not the run: a resumed run's differ from an uninterrupted one's.
TIMING_FIELDS = ("wall_time_s", "tokens_per_s")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a last line cut short by a kill is dropped. A record that is not an
    object with an integer ``step`` >= 0 (a file edited by hand, or not tlm's) is one line naming the file."""
    from tlm_train.metrics import MetricsLog

    try:  # a FIFO, device or folder in its place is refused by the checked read, never waited on
        records = MetricsLog(path).read()
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    for number, record in enumerate(records, 1):
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            what = f"step {json.dumps(step)}" if isinstance(record, dict) and "step" in record else "no step"
            if not isinstance(record, dict):
                what = f"a {type(record).__name__}, not an object"
            raise UserError(f"{path}: line {number}: expected a record with an integer step >= 0, got {what}")
    return records


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def summarize(path: Path, *, name: str | None = None, settings: dict[str, Any] | None = None,
              status: str | None = None, message: str | None = None,
              unstable_above: float = UNSTABLE_ABOVE) -> RunSummary:  # fmt: skip
    """A run folder's :class:`RunSummary`. ``status`` (a sweep's record of how the run ended: ``diverged``
    or ``failed``, with ``message``) wins over what the folder says; without it, the run is diverged when its
    metrics record the divergence, finished when they reach its last step (``unstable`` when some evaluation
    exceeded ``unstable_above`` × its first), else ``interrupted``."""
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
    unstable_at = _unstable_at(curve, unstable_above)
    if status == "failed":
        pass
    elif diverged:
        status = "diverged"
    elif steps >= planned:
        status = "done" if unstable_at is None else "unstable"
    else:
        status = "interrupted"
    times = [r["time_s"] for r in records if _finite(r.get("time_s"))]
    tokens = max((int(r["tokens"]) for r in records if _finite(r.get("tokens"))), default=0)
    wall = times[-1] if times else None
    finished = status in ("done", "unstable")
    final = curve[-1][2] if finished and curve and curve[-1][0] == steps else None
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
        seed=config.seed,
        unstable_at=unstable_at,
        message=message if status == "failed" else None,
        curve=curve,
    )


@dataclass(frozen=True)
class RunData:
    """What a run's losses are measured against: SHA-256 digests of its tokenizer's files and of its data (the
    ``--data`` and ``--val-data`` files' contents, or the built-in corpus, with ``val_fraction`` and ``text_field``,
    as its ``train.toml`` names them), and the bits per byte per nat per token of its validation (``val_bpb /
    val_loss`` of its metrics, else estimated over the whole validation file). None where the folder cannot say
    (no tokenizer; a data file since moved)."""

    tokenizer: str | None
    data: str | None
    bpb_per_nat: float | None


def run_data(path: Path, records: list[dict[str, Any]] | None = None) -> RunData:
    """The :class:`RunData` of the run folder ``path`` (``records``: its metrics, when read already)."""
    import hashlib

    from tlm_train import RunDir
    from tlm_train.data import file_identity

    run = RunDir(path)
    if not (run.path / "train.toml").is_file():  # a run that failed before it started: nothing to say
        return RunData(None, None, None)
    config = run.read_config()
    records = read_metrics(run.path / "metrics.jsonl") if records is None else records
    scored = [r for r in records if _finite(r.get("val_loss")) and _finite(r.get("val_bpb")) and r["val_loss"] > 0]
    ratio = scored[0]["val_bpb"] / scored[0]["val_loss"] if scored else None
    names = [*config.data, *config.val_data]
    files = [file_identity(name, "data file")["sha256"] if Path(name).exists() else None for name in names]
    sources = {"data": files[: len(config.data)] if config.data else "the built-in corpus",
               "val_data": files[len(config.data) :], "val_fraction": config.val_fraction,
               "text_field": config.text_field}  # fmt: skip
    data = None if None in files else hashlib.sha256(json.dumps(sources, sort_keys=True).encode()).hexdigest()
    if not run.has_tokenizer():
        return RunData(None, data, ratio)
    digest = hashlib.sha256()
    for file in sorted(f for f in run.tokenizer_dir.iterdir() if f.is_file()):
        digest.update(file.name.encode() + b"\0" + read_input(file, "tokenizer file") + b"\0")
    val = run.data_dir / "val.npy"
    if ratio is None and val.exists():  # the whole validation file's bytes per token, special tokens counting none
        import numpy as np

        tokenizer = run.tokenizer()
        check_input(val, "run token file")  # a FIFO or device in its place is one line, not a hang
        ids = np.load(val, mmap_mode="r").astype(np.int64)
        ids = np.where(ids < 0, -1 - ids, ids).tolist()  # chat data keeps a masked target as -1 - id
        specials = {tokenizer.encode(s)[0] for s in tokenizer.special_tokens}
        size = sum(0 if i in specials else len(tokenizer.vocab.get(i, b"")) for i in ids)
        ratio = len(ids) / (math.log(2) * size) if size else None
    return RunData(digest.hexdigest(), data, ratio)


#: The unit of the losses ``tlm compare`` reports: nats per token, or bits per byte where the tokenizers differ.
NATS, BITS_PER_BYTE = "nats/token", "bits/byte"


def harmonize(summaries: list[RunSummary]) -> str:
    """Make the runs' losses comparable, or refuse: runs of different data (:class:`RunData`'s digest) are a
    ``UserError`` naming two of them; runs whose tokenizers differ get their losses (final, best, the curve) in
    bits per byte of the validation text, and :data:`BITS_PER_BYTE` is returned (else :data:`NATS`, unchanged).
    Where a folder cannot say (a data file since moved), its run is compared as it is. Without ``--val-data``
    each run validates on the last ``val_fraction`` of its own tokens: across tokenizers, nearly the same text."""
    started = [s for s in summaries if (Path(s.path) / "train.toml").is_file()]  # a failed run may have none
    data = [run_data(Path(s.path)) for s in started]
    known = [(s, d) for s, d in zip(started, data, strict=True) if d.data is not None]
    if len({d.data for _, d in known}) > 1:
        (first, one), (second, other) = known[0], next((s, d) for s, d in known if d.data != known[0][1].data)
        raise UserError(
            f"{first.path} and {second.path} were trained and validated on different data (digests "
            f"{str(one.data)[:12]}… and {str(other.data)[:12]}…): their losses do not compare; compare runs of one "
            "data set"
        )
    tokenizers = {d.tokenizer for d in data}
    if len(tokenizers) < 2:
        return NATS
    if lacking := [s for s, d in zip(started, data, strict=True) if d.tokenizer is None or d.bpb_per_nat is None]:
        raise UserError(
            f"the runs' tokenizers differ, and {lacking[0].path} gives no bits per byte (no tokenizer or validation "
            "tokens in its folder): their losses do not compare"
        )
    known = list(zip(started, data, strict=True))
    for s, d in known:
        f = cast(float, d.bpb_per_nat)
        s.final_val_loss = None if s.final_val_loss is None else s.final_val_loss * f
        s.best_val_loss = None if s.best_val_loss is None else s.best_val_loss * f
        s.curve = [(step, time, value * f) for step, time, value in s.curve]
    return BITS_PER_BYTE


def _unstable_at(curve: list[tuple[int, float | None, float]], above: float) -> int | None:
    """The step of the first evaluation above ``above`` × the first one (the starting loss), else None."""
    if not curve:
        return None
    limit = above * curve[0][2]
    return next((step for step, _, value in curve[1:] if value > limit), None)


def status_text(s: RunSummary) -> str:
    """How a run ended, in words for a table: ``diverged at step 33``, ``unstable (step 40: 9.21, 1.5× its start)``."""
    if s.status == "diverged":
        return f"diverged at step {s.diverged_at}" if s.diverged_at is not None else "diverged"
    if s.status == "unstable" and s.curve:
        peak = next(v for step, _, v in s.curve if step == s.unstable_at)
        return f"unstable (step {s.unstable_at}: {peak:.2f}, {peak / s.curve[0][2]:.2f}× its start {s.curve[0][2]:.2f})"
    if s.status == "interrupted":
        return f"interrupted at step {s.steps} (resumable; not a result)"
    if s.status == "failed":
        return f"failed: {s.message}" if s.message else "failed"
    return s.status


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


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3g}"
    return str(value)


def markdown(summaries: list[RunSummary], unit: str = NATS) -> str:
    """The comparison as a Markdown table, one row per run (the losses in ``unit``: :func:`harmonize`)."""
    what = "loss" if unit == NATS else "bits/byte"
    head = ["run", "settings", "status", "steps", "parameters", f"final val {what}", f"best val {what}", "tokens",
            "wall time (s)", "tokens/s"]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        settings = ", ".join(f"{k}={setting_text(v)}" for k, v in s.settings.items()) or "–"
        status = status_text(s)
        cells = [s.name, settings, status, f"{s.steps}/{s.planned_steps}", f"{s.parameters:,}",
                 _fmt(s.final_val_loss), _fmt(s.best_val_loss), f"{s.tokens:,}", _fmt(s.wall_time_s, 1),
                 _fmt(s.tokens_per_s, 0)]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def plot(summaries: list[RunSummary], out: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """The comparison's figure (:func:`tlm_experiments.results.figure`) in one PNG, written whole."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'tlm-command[plot]'") from None
    import matplotlib.pyplot as plt

    from tlm_core.atomic import atomic_write
    from tlm_experiments.results import figure

    fig = figure(summaries, title=title)
    out = Path(out)
    atomic_write(out, lambda file: fig.savefig(file, format="png", dpi=100))
    plt.close(fig)
    return out


def sweep_runs(folder: Path) -> list[tuple[str, Path, dict[str, Any], str]]:
    """(name, folder, settings, status) of each run a sweep's manifest lists."""
    manifest = read_manifest(folder)
    for run in manifest["runs"]:
        if (folder / run["name"]).is_symlink():
            raise UserError(f"{folder / run['name']} is a symbolic link: a sweep's runs are folders of their own")
    return [(r["name"], folder / r["name"], r["settings"], r["status"]) for r in manifest["runs"]]


def _messages(folder: Path) -> dict[str, str]:
    """Why each failed run of a sweep failed, as its manifest says."""
    return {r["name"]: str(r["message"]) for r in read_manifest(folder)["runs"] if r.get("message")}


def collect(paths: list[str], *, unstable_above: float = UNSTABLE_ABOVE) -> list[RunSummary]:
    """The summaries of the named runs and of every run of the named sweeps, in order."""
    summaries: list[RunSummary] = []
    plain: list[Path] = []
    for given in paths:
        path = Path(given)
        if (path / MANIFEST).is_file():
            messages = _messages(path)
            for name, folder, settings, status in sweep_runs(path):
                if (folder / "train.toml").is_file():
                    summaries.append(summarize(folder, name=name, settings=settings, status=sweep_status(status),
                                               message=messages.get(name), unstable_above=unstable_above))  # fmt: skip
        elif (path / "train.toml").is_file():
            plain.append(path)
        else:
            raise UserError(f"{given}: neither a run folder (train.toml) nor a sweep folder ({MANIFEST})")
    if plain:
        for path, settings in zip(plain, differing(plain) if len(plain) > 1 else [{}], strict=True):
            summaries.append(summarize(path, settings=settings, unstable_above=unstable_above))
    names = [s.name for s in summaries]
    for s in summaries:  # runs of different folders may share a name: name them by their path instead
        if names.count(s.name) > 1:
            s.name = s.path
    return summaries


def sweep_status(status: str) -> str | None:
    """What a sweep's manifest says of a run that :func:`summarize` takes: whether it diverged or failed (the
    sweep knows); whether the others finished, the folder says."""
    return status if status in ("diverged", "failed") else None


def _baseline(groups: list[Any], baseline: str | None) -> str:
    """The label of the baseline setting: ``baseline`` as given (``--baseline``, checked), else the setting
    named ``baseline``, else the first."""
    from tlm_experiments.results import baseline_index

    labels = [g.label for g in groups]
    if baseline is not None and baseline not in labels:
        raise UserError(f"--baseline {baseline}: no such setting; the settings are {', '.join(labels)}")
    return baseline if baseline is not None else labels[baseline_index(groups)] if groups else "baseline"


def report(summaries: list[RunSummary], *, unstable_above: float = UNSTABLE_ABOVE,
           baseline: str | None = None, unit: str = NATS) -> dict[str, Any]:  # fmt: skip
    """The runs and each setting's statistics, as ``tlm compare --json`` prints them and ``summary.json`` holds."""
    from tlm_experiments.results import group_runs, statistics

    groups = group_runs(summaries)
    label = _baseline(groups, baseline)
    return {
        "unstable_above": unstable_above,
        "loss_unit": unit,
        "baseline": label if groups else None,
        "runs": [s.to_dict() for s in summaries],
        "settings": [st.to_dict() for st in statistics(groups, baseline=label)],
    }


def full_markdown(summaries: list[RunSummary], *, baseline: str | None = None, unit: str = NATS) -> str:
    """The run table, then the table of each setting's statistics against the baseline (losses in ``unit``)."""
    from tlm_experiments.results import group_runs, statistics, stats_markdown

    groups = group_runs(summaries)
    table = stats_markdown(statistics(groups, baseline=_baseline(groups, baseline)))
    if unit != NATS:
        table = table.replace("val loss", f"val {unit}")
        note = "Losses in bits per byte of the same validation text: the runs' tokenizers differ.\n\n"
        return note + markdown(summaries, unit) + "\n" + table
    return markdown(summaries, unit) + "\n" + table
