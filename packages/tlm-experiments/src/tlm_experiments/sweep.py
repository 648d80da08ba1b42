"""``tlm sweep``: a set of training runs over any train or model setting, in one folder, resumable.

A grid gives the product of its keys' values; a TOML file names its runs (e.g. ablations beside a
baseline). Settings are TrainConfig fields (lr, batch_size, steps, ...) and ModelConfig fields
(d_model, or model.d_model); each value is read as TOML (1e-3, 64, true), else taken as text:

    tlm sweep --out-dir sweeps/lr --grid lr=1e-4,3e-4,1e-3,3e-3 --set steps=200
    tlm sweep --out-dir sweeps/lr-bs --grid lr=1e-3,3e-3 --grid batch_size=8,32 --config base.toml
    tlm sweep --out-dir sweeps/ablations --runs ablations.toml --seeds 3
    tlm sweep --resume sweeps/lr

A runs file holds an optional [base] table of shared settings and one [runs.NAME] table per run:

    [base]
    steps = 200
    [runs.baseline]
    [runs.post-norm]
    model = { norm_placement = "post" }

Each run is an ordinary tlm train run folder, SWEEP/NAME/, that every command reads (tlm generate,
eval, compare...). SWEEP/sweep.json, the manifest, is rewritten whole as each run starts and ends.
A run whose loss stops being finite is recorded as diverged and the sweep goes on. --seeds N runs every
setting N times, with seeds SEED, SEED+1, ... (SEED the base's, 0 by default; or give seed in a grid),
and the summary gives each setting's mean, standard deviation and N, and its difference from the
baseline (the run or setting named baseline, else the first) with a 95% interval. --resume keeps the
finished runs and continues the others, each from its newest checkpoint. --jobs N trains N runs at
once, each in its own process with 1/N of the CPU threads (OMP_NUM_THREADS, else the CPUs this process
may use); by default, on the CPU, one single-threaded run per thread. At the end: SWEEP/summary.json,
summary.md and sweep.png (validation loss by step and by wall-clock time, final loss by the swept setting).
How each run ended: done, diverged (at step S), unstable (finished, but an evaluation exceeded
--unstable-above × its first: 1.5 by default), interrupted (resumable; not a result) or failed.
"""

import contextlib
import itertools
import json
import math
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from tlm_core.atomic import check_input, read_input
from tlm_core.checks import check_bool, check_choice, check_number, check_positive_int, rephrased, short_repr
from tlm_core.cli import UserError, say
from tlm_experiments.compare import UNSTABLE_ABOVE
from tlm_experiments.manifest import (
    FORMAT,
    LOCK,
    MANIFEST,
    PLOT,
    SUMMARY_JSON,
    SUMMARY_MD,
    check_name,
    read_manifest,
    write_manifest,
)
from tlm_experiments.runs import apply, train_run

#: How a run ended: these are kept by --resume; the others (pending, running, interrupted, failed) run again.
FINISHED = ("done", "diverged")
#: Where runs train: this machine's processes, or the tasks of a SLURM job array (tlm_experiments.slurm).
LAUNCHERS = ("local", "slurm")
#: The flags that only --launcher slurm takes.
SLURM_FLAGS = ("partition", "time", "cpus_per_task", "gpus")
#: The most runs a plan may hold unless --max-runs says otherwise: a grid's product grows fast.
MAX_RUNS = 1000


@dataclass(frozen=True)
class SweepOptions:
    """One sweep, as :func:`run` takes it: a new one (``out_dir`` with ``grid`` or ``runs``) or ``resume`` of
    one. Each field is the ``tlm sweep`` flag of its name (``set``: ``--set``), with its default."""

    out_dir: str | None = None
    resume: str | None = None
    grid: Sequence[str] = ()
    runs: str | None = None
    config: str | None = None
    set: Sequence[str] = ()
    seeds: int | None = None
    max_runs: int = MAX_RUNS
    jobs: int | None = None
    quiet: bool = False
    unstable_above: float = UNSTABLE_ABOVE
    baseline: str | None = None
    launcher: str | None = None  # one of LAUNCHERS; None: local, or as the sweep was
    partition: str | None = None
    time: int | None = None
    cpus_per_task: int | None = None
    gpus: int | None = None

    def __post_init__(self) -> None:
        for name in ("grid", "set"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
                raise TypeError(f"SweepOptions.{name} must be a list of 'KEY=...' strings, got {short_repr(value)}")
        for name in ("seeds", "max_runs", "jobs", "time", "cpus_per_task", "gpus"):
            if getattr(self, name) is not None:
                check_positive_int(f"SweepOptions.{name}", getattr(self, name))
        check_number("SweepOptions.unstable_above", self.unstable_above, low=0, low_open=True)
        check_bool("SweepOptions.quiet", self.quiet)
        if self.launcher is not None:
            check_choice("SweepOptions.launcher", self.launcher, LAUNCHERS)


# ------------------------------------------------------------------------------------------ settings


def _value(text: str) -> Any:
    """A setting's value: TOML's reading of ``text`` (1e-3, 64, true, "x", [1, 2]), else the text itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _split(text: str, flag: str) -> tuple[str, str]:
    key, sep, values = text.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise UserError(f"{flag} {text!r}: expected KEY=VALUE")
    return key.strip(), values.strip()


def _key(name: str, flag: str) -> str:
    """The flat name of a setting: a TrainConfig field (``lr``), or ``model.<field>`` for a ModelConfig one."""
    import dataclasses

    from tlm_model.config import FIELDS as MODEL_FIELDS
    from tlm_train.config import TrainConfig

    name = name.replace("-", "_")
    train = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in ("model", "out_dir")]
    if name.startswith("model."):
        if name[6:] in MODEL_FIELDS:
            return name
    elif name in train:
        return name
    elif name in MODEL_FIELDS:
        return f"model.{name}"
    raise UserError(
        f"{flag} {name}: not a setting; expected a TrainConfig field ({', '.join(train)}) or a ModelConfig field "
        f"({', '.join(MODEL_FIELDS)})"
    )


def _flatten(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """A TOML table of settings (a ``model`` sub-table) as flat names."""
    flat = {}
    for name, value in settings.items():
        if name == "model":
            if not isinstance(value, dict):
                raise UserError(f"{where}: model must be a table of ModelConfig fields, got {value!r}")
            flat.update({_key(f"model.{k}", where): v for k, v in value.items()})
        else:
            flat[_key(name, where)] = value
    return flat


def _label(key: str, text: str) -> str:
    return f"{key.removeprefix('model.')}={text}"


def expand_grid(
    grid: Sequence[str], *, max_runs: int | None = None, seeds: int = 1
) -> list[tuple[str, dict[str, Any]]]:
    """(name, settings) of every combination of the ``--grid KEY=V1,V2`` values, the first key slowest. A product
    that, run ``seeds`` times each, makes more than ``max_runs`` runs is refused with its size before any is made."""
    axes: list[tuple[str, list[tuple[str, Any]]]] = []
    for item in grid:
        key, values = _split(item, "--grid")
        flat = _key(key, "--grid")
        if any(flat == other for other, _ in axes):
            raise UserError(f"--grid {key} is given twice")
        texts = [v.strip() for v in values.split(",")]
        if any(not t for t in texts):
            raise UserError(f"--grid {item!r}: an empty value")
        axes.append((flat, [(t, _value(t)) for t in texts]))
    size = math.prod(len(values) for _, values in axes) * seeds
    if max_runs is not None and size > max_runs:
        sizes = " x ".join([*(str(len(values)) for _, values in axes), *([f"{seeds} seeds"] if seeds > 1 else [])])
        raise UserError(
            f"--grid: {sizes} = {size:,} runs, more than --max-runs {max_runs:,}; split the sweep or raise it"
        )
    runs = []
    for combination in itertools.product(*(values for _, values in axes)):
        keys = [key for key, _ in axes]
        name = ",".join(_label(k, text) for k, (text, _) in zip(keys, combination, strict=True))
        runs.append((name, {k: value for k, (_, value) in zip(keys, combination, strict=True)}))
    return runs


def _parsed(file: Path, loads: Callable[[str], Any], error: type[Exception], what: str, flag: str) -> Any:
    """``file``'s UTF-8 text through ``loads``; text that is not UTF-8 or that ``loads`` refuses is one
    line, ``what: the parser's words``. The file is read through the checked open: missing, a FIFO, a device or
    a folder is one line naming ``flag`` and the path, never waited on."""
    data = read_input(file, flag)
    try:
        return loads(data.decode("utf-8"))
    except (error, UnicodeDecodeError) as err:
        raise UserError(f"{what}: {err}") from None


def _read_runs_file(path: str) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    file = Path(path)
    data = _parsed(file, tomllib.loads, tomllib.TOMLDecodeError, f"--runs {path} is not valid TOML", "--runs")
    if unknown := sorted(set(data) - {"base", "runs"}):
        raise UserError(f"--runs {path}: unknown tables {unknown}; expected [base] and [runs.NAME]")
    runs = data.get("runs", {})
    if not isinstance(runs, dict) or not runs or not all(isinstance(r, dict) for r in runs.values()):
        raise UserError(f"--runs {path}: expected one or more [runs.NAME] tables")
    base = _flatten(data.get("base", {}), f"--runs {path} [base]")
    return base, [(name, _flatten(table, f"--runs {path} [runs.{name}]")) for name, table in runs.items()]


def plan(args: SweepOptions, out: Path) -> dict[str, Any]:
    """The manifest of a new sweep: every run's settings, each checked as a TrainConfig before anything runs."""
    from tlm_train.config import TrainConfig

    if bool(args.grid) == bool(args.runs):
        raise UserError("give --grid KEY=V1,V2,... (one or more) or --runs FILE.toml")
    base = TrainConfig() if args.config is None else _base_config(args.config)
    flat_base: dict[str, Any] = {}
    max_runs = args.max_runs
    seeds = args.seeds or 1  # counted before any run is made: --seeds multiplies the plan
    if args.runs:
        flat_base, runs = _read_runs_file(args.runs)
        if len(runs) * seeds > max_runs:
            times = f" x {seeds} seeds = {len(runs) * seeds:,} runs" if seeds > 1 else " runs"
            raise UserError(f"--runs {args.runs}: {len(runs):,}{times}, more than --max-runs {max_runs:,}")
    else:
        runs = expand_grid(args.grid, max_runs=max_runs, seeds=seeds)
    for item in args.set:
        key, text = _split(item, "--set")
        flat_base[_key(key, "--set")] = _value(text)
    base_dict = apply({k: v for k, v in base.to_dict().items() if k != "out_dir"}, flat_base)
    if args.seeds is not None:
        runs = with_seeds(runs, args.seeds, int(base_dict.get("seed", 0)))
    names = [name for name, _ in runs]
    for name in names:
        check_name(name, "run name")
        if names.count(name) > 1:
            raise UserError(f"run name {name!r} is given twice")
    from tlm_train.recipe import input_paths
    from tlm_train.run_dir import check_apart

    for name, settings in runs:
        try:
            config = TrainConfig.from_dict({**apply(base_dict, settings), "out_dir": str(out / name)})
            # The sweep's folder (its manifest, summary and every run) overlaps nothing a run reads.
            check_apart(out, input_paths(config))
        except (TypeError, ValueError) as err:
            raise rephrased(err, f"run {name}: {_setting_names(str(err))}") from None
    entries = [{"name": n, "settings": s, "status": "pending"} for n, s in runs]
    return {"format": FORMAT, "base": base_dict, "runs": entries}


def with_seeds(runs: list[tuple[str, dict[str, Any]]], n: int, first: int) -> list[tuple[str, dict[str, Any]]]:
    """Each run ``n`` times, with seeds ``first`` .. ``first + n - 1`` (``NAME,seed=K``), the seed fastest."""
    if any("seed" in settings for _, settings in runs):
        raise UserError("--seeds N and seed in a grid or a run's settings: give the seeds one way")
    return [(f"{name},seed={first + k}", {**settings, "seed": first + k}) for name, settings in runs for k in range(n)]


def _setting_names(message: str) -> str:
    """Settings named as a sweep names them: ``TrainConfig.model: ModelConfig.d_ff`` -> ``model.d_ff``."""
    message = re.sub(r"TrainConfig\.model: ModelConfig\.(\w+)", r"model.\1", message)
    return re.sub(r"(?:TrainConfig|ModelConfig)\.(\w+)", r"\1", message)


def _base_config(path: str) -> Any:
    from tlm_train.config import TrainConfig

    check_input(path, "--config")  # missing, a FIFO, a device or a folder: one line naming --config
    return TrainConfig.from_toml(path)


# ------------------------------------------------------------------------------------------ the manifest


def _check_resumable(folder: Path, manifest: dict[str, Any]) -> None:
    """Refuse, before anything is written, a run folder that is a symbolic link (a run would train wherever it
    points) and a run still to train whose settings are not a TrainConfig (a manifest edited by hand)."""
    from tlm_train.config import TrainConfig

    for i, entry in enumerate(manifest["runs"]):
        path = folder / entry["name"]
        if path.is_symlink():  # a finished run's too: the summary would read wherever it points
            raise UserError(f"{path} is a symbolic link: tlm sweep never trains into one; remove it")
        if entry["status"] in FINISHED:
            continue
        try:
            TrainConfig.from_dict({**apply(manifest["base"], entry["settings"]), "out_dir": str(path)})
        except (TypeError, ValueError) as err:
            raise UserError(f"{folder / MANIFEST}: runs[{i}] ({entry['name']}): {_setting_names(str(err))}") from None


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One process runs a sweep at a time: ``SWEEP/.lock`` held as a run folder's lock is (``flock``, freed by
    the kernel when the holder dies; opened with ``O_NOFOLLOW``, so a symlink planted there is refused)."""
    from tlm_train.run_dir import RunInUseError, RunLock

    try:
        held = RunLock(folder / LOCK, command="tlm sweep")
    except RunInUseError:
        raise UserError(f"{folder} is in use by another tlm sweep; wait for it to finish") from None
    try:
        yield
    finally:
        held.release()


# ------------------------------------------------------------------------------------------ running


def cpu_threads() -> int:
    """The CPU threads a sweep may use: OMP_NUM_THREADS, else the CPUs this process may run on."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_run(jobs: int) -> int:
    """The CPU threads each of ``jobs`` concurrent runs gets: :func:`cpu_threads` divided among them, at least one."""
    return max(1, cpu_threads() // jobs)


def default_jobs(manifest: dict[str, Any]) -> int:
    """On the CPU, one run per thread (each run single-threaded): on 2 cores, two runs with one thread each
    finished sooner than one run at a time with two (bench/sweep_jobs.py, docs/sweep_jobs.md). On an
    accelerator, one run at a time."""
    if str(manifest["base"].get("device", "cpu")) != "cpu":
        return 1
    return cpu_threads()


def _init_worker(threads: int) -> None:
    """A --jobs worker: its share of the threads, Ctrl-C left to the run's own handler (which checkpoints),
    and death with the sweep process, so a killed sweep leaves no run training on its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # while no run trains: a run installs its own handlers
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    import torch

    torch.set_num_threads(threads)


def _die_with_parent() -> None:
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)


class Sweep:
    """The runs of one sweep folder: trains those not finished, one after another or ``jobs`` at once."""

    def __init__(self, folder: Path, manifest: dict[str, Any], *, jobs: int, quiet: bool) -> None:
        self.folder, self.manifest, self.jobs, self.quiet = folder, manifest, jobs, quiet

    def job(self, entry: dict[str, Any]) -> dict[str, Any]:
        config = {**apply(self.manifest["base"], entry["settings"]), "out_dir": str(self.folder / entry["name"])}
        return {"name": entry["name"], "config": config, "quiet": self.quiet}

    def _started(self, entry: dict[str, Any]) -> None:
        entry["status"] = "running"
        entry.pop("message", None)
        write_manifest(self.folder, self.manifest)
        if not self.quiet:
            runs = self.manifest["runs"]
            say(f"run {entry['name']} ({runs.index(entry) + 1} of {len(runs)})")

    def _ended(self, entry: dict[str, Any], outcome: dict[str, Any]) -> bool:
        """Record a run's outcome; whether the sweep must stop (the run was stopped, or a stop came as it ended)."""
        stop = bool(outcome.pop("stop", False)) or outcome["status"] == "interrupted"
        entry.update(outcome)
        write_manifest(self.folder, self.manifest)
        if not self.quiet:
            detail = f" ({outcome['message']})" if "message" in outcome else ""
            say(f"run {entry['name']}: {outcome['status']}{detail}")
        return stop

    def run(self) -> bool:
        """Train every run not finished; False when stopped by Ctrl-C/SIGTERM (each run checkpointed)."""
        todo = [e for e in self.manifest["runs"] if e["status"] not in FINISHED]
        if self.jobs == 1 or len(todo) <= 1:
            return self._one_by_one(todo)
        return self._at_once(todo)

    def _one_by_one(self, todo: list[dict[str, Any]]) -> bool:
        import torch

        previous = torch.get_num_threads()
        torch.set_num_threads(threads_per_run(1))
        try:
            for entry in todo:
                self._started(entry)
                if self._ended(entry, train_run(self.job(entry))):
                    return False
        finally:
            torch.set_num_threads(previous)
        return True

    def _at_once(self, todo: list[dict[str, Any]]) -> bool:
        import multiprocessing
        from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

        workers = min(self.jobs, len(todo))
        pool = ProcessPoolExecutor(
            workers,
            # Spawned, not forked (a fork copies torch's thread pool), so each worker is this process's child
            # and dies with it.
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(threads_per_run(self.jobs),),
        )
        queue = list(todo)
        running: dict[Future[dict[str, Any]], dict[str, Any]] = {}
        stopping = False
        with pool:
            while queue or running:
                while queue and not stopping and len(running) < workers:
                    entry = queue.pop(0)
                    self._started(entry)
                    running[pool.submit(train_run, self.job(entry))] = entry
                if not running:
                    break
                try:
                    finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                except KeyboardInterrupt:  # each run checkpoints and returns "interrupted"
                    stopping = True
                    _forward_interrupt(pool)
                    continue
                for future in finished:
                    entry = running.pop(future)
                    stopping = self._ended(entry, _outcome(future)) or stopping
        return not stopping


def _forward_interrupt(pool: Any) -> None:
    """A SIGINT sent to the sweep alone reaches its runs as SIGTERM, which each run's handler takes as the same
    request (checkpoint, then return). Not SIGINT: after a Ctrl-C in a terminal, which reaches every worker
    already, a second SIGINT would interrupt a run at once, without its checkpoint."""
    for process in list(getattr(pool, "_processes", {}).values()):  # the executor keeps no public list
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)


def _outcome(future: Any) -> dict[str, Any]:
    try:
        return dict(future.result())
    except Exception as err:  # a worker that died (killed, out of memory) fails its run only
        return {"status": "failed", "message": f"{type(err).__name__}: {err}"}


# ------------------------------------------------------------------------------------------ the summary


def summarize(folder: Path, manifest: dict[str, Any], *, unstable_above: float = UNSTABLE_ABOVE) -> list[Any]:
    """Each started run's :class:`~tlm_experiments.compare.RunSummary` (its path relative to the sweep); a run that
    failed before its folder held anything is there too, with its message."""
    from tlm_experiments.compare import RunSummary, sweep_status
    from tlm_experiments.compare import summarize as summarize_run

    summaries = []
    for entry in manifest["runs"]:
        path = folder / entry["name"]
        if path.is_symlink() or not (path / "train.toml").is_file():  # a link planted since the sweep began
            if entry["status"] == "failed" and not path.is_symlink():
                summaries.append(RunSummary(
                    entry["name"], entry["name"], entry["settings"], "failed", 0, 0, None, None, 0, 0, None, None,
                    False, seed=entry["settings"].get("seed"), message=entry.get("message"),
                ))  # fmt: skip
            continue
        status = sweep_status(entry["status"])
        summary = summarize_run(path, name=entry["name"], settings=entry["settings"], status=status,
                                message=entry.get("message"), unstable_above=unstable_above)  # fmt: skip
        summary.path = entry["name"]
        summaries.append(summary)
    return summaries


def write_summary(
    folder: Path,
    manifest: dict[str, Any],
    *,
    quiet: bool,
    unstable_above: float = UNSTABLE_ABOVE,
    baseline: str | None = None,
) -> list[Any]:
    """summary.json, summary.md and sweep.png (when matplotlib is installed), each written whole."""
    from tlm_core.atomic import atomic_write
    from tlm_experiments.compare import NATS, full_markdown, harmonize, plot, report

    summaries = summarize(folder, manifest, unstable_above=unstable_above)
    try:  # a sweep over the tokenizer (vocab_size) compares in bits per byte
        unit = harmonize(summaries)
    except UserError as err:  # runs validated on other text: the summary says so, in nats
        unit, note = NATS, f"**Not comparable:** {err}\n\n"
    else:
        note = ""
    data = {"format": FORMAT, **report(summaries, unstable_above=unstable_above, baseline=baseline, unit=unit)}
    atomic_write(folder / SUMMARY_JSON, json.dumps(data, indent=2, allow_nan=False) + "\n")
    text = full_markdown(summaries, baseline=baseline, unit=unit)
    atomic_write(folder / SUMMARY_MD, f"# Sweep {folder.name}\n\n{note}" + text)
    if summaries:
        try:
            plot(summaries, folder / PLOT, title=f"sweep {folder.name}")
        except ImportError as err:
            if not quiet:
                say(f"{err}: no {PLOT}")
    return summaries


def _launcher(args: SweepOptions, manifest: dict[str, Any]) -> str:
    """``--launcher``, else the sweep's own (a resumed SLURM sweep stays on SLURM), else local; the cluster is
    checked (SLURM there, the partition known) before anything is written."""
    saved = manifest.get("launcher")
    launcher = args.launcher or (saved.get("name") if isinstance(saved, dict) else None) or "local"
    if launcher == "local":
        given = [name for name in SLURM_FLAGS if getattr(args, name) is not None]
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} is for --launcher slurm")
        return launcher
    from tlm_experiments import slurm

    manifest["launcher"] = slurm.options(args, manifest)
    slurm.check_cluster(manifest["launcher"]["partition"])
    return launcher


def _run_on_slurm(folder: Path, manifest: dict[str, Any], args: SweepOptions) -> tuple[dict[str, Any], bool]:
    """Submit the runs not finished as one job array and wait for it; the manifest the tasks left."""
    from tlm_experiments import slurm

    slurm.check_writable(folder)
    if queued := slurm.still_queued(manifest):
        raise UserError(
            f"{folder}: runs {queued} are still in SLURM's queue; wait for them (squeue) or scancel them, then --resume"
        )
    todo = [e for e in manifest["runs"] if e["status"] not in FINISHED]
    for entry in todo:
        entry.update(status="pending")
        entry.pop("job", None)
    write_manifest(folder, manifest)
    if not todo:
        return manifest, True
    array = slurm.submit(folder, manifest, todo, jobs=args.jobs)
    if not args.quiet:
        say(f"submitted {len(todo)} runs as SLURM job array {array} (logs in {folder / slurm.LOGS})")
    try:
        manifest = slurm.wait(folder, [e["name"] for e in todo], quiet=args.quiet)
    except KeyboardInterrupt:  # the jobs go on without this process
        say(f"the jobs of array {array} go on; once they end, tlm sweep --resume {folder} summarizes the sweep")
        raise
    return manifest, True


def run(args: SweepOptions) -> int:
    """Plan a new sweep (or read one to resume), train its runs not finished, write its summary; the exit
    status of ``tlm sweep``: 0 when every run finished (the summary printed unless ``quiet``), 1 when some
    failed, 130 when stopped (resumable)."""
    if args.resume is not None:
        if args.out_dir is not None or args.grid or args.runs or args.config or args.set or args.seeds:
            raise UserError(
                "--resume continues a sweep as planned; it takes only --jobs, --unstable-above, --baseline, --quiet "
                "and the launcher's flags"
            )
        folder = Path(args.resume)
        manifest = read_manifest(folder)
        _check_resumable(folder, manifest)
    else:
        if args.out_dir is None:
            raise UserError("give --out-dir SWEEP for a new sweep, or --resume SWEEP")
        folder = Path(args.out_dir)
        if (folder / MANIFEST).is_file():
            raise UserError(f"--out-dir {folder} already holds a sweep: continue it with --resume {folder}")
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise UserError(f"--out-dir {folder} exists and is not an empty folder; choose another")
        manifest = plan(args, folder)
    on_slurm = _launcher(args, manifest) == "slurm"
    jobs = args.jobs or manifest.get("jobs") or default_jobs(manifest)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        manifest["jobs"] = jobs
        if on_slurm:
            manifest, completed = _run_on_slurm(folder, manifest, args)
        else:
            manifest.pop("launcher", None)
            write_manifest(folder, manifest)
            completed = Sweep(folder, manifest, jobs=jobs, quiet=args.quiet).run()
        write_summary(folder, manifest, quiet=args.quiet, unstable_above=args.unstable_above, baseline=args.baseline)
    if not completed:
        say(f"sweep stopped: continue it with tlm sweep --resume {folder}")
        return 130
    failed = [e["name"] for e in manifest["runs"] if e["status"] not in FINISHED]
    if failed:
        print(f"tlm: error: runs {failed} failed (see {folder / MANIFEST}); retry them with --resume", file=sys.stderr)
        return 1
    if not args.quiet:
        sys.stdout.write(read_input(folder / SUMMARY_MD, "sweep summary").decode("utf-8"))
    return 0
