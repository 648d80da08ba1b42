"""A sweep folder's manifest, ``SWEEP/sweep.json``, and the rule for run names: what ``tlm sweep`` and
``tlm compare`` both read (this module imports neither, so they do not import each other).

The manifest is read as untrusted input: a file edited by hand, or planted, is refused in one line that
names the field, before any run folder is opened. A run name is one plain path component (letters,
digits and ``. _ = , + -``, not starting with a dot, at most :data:`MAX_NAME_BYTES` bytes, none of the
sweep's own file names), wherever it comes from: a grid, a runs file or the manifest.
"""

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tlm_core.atomic import read_input
from tlm_core.cli import UserError

#: The file that makes a folder a sweep (``tlm sweep`` writes it).
MANIFEST = "sweep.json"
FORMAT = "tlm-sweep/1"
SUMMARY_JSON, SUMMARY_MD, PLOT, LOCK = "summary.json", "summary.md", "sweep.png", ".lock"
#: How a run may stand in the manifest (``stopped``: an ``interrupted`` run, as older manifests say).
#: ``submitted`` and ``requeued``: a run whose SLURM task is queued, or was requeued at a checkpoint.
STATUSES = ("pending", "running", "interrupted", "stopped", "failed", "done", "diverged", "submitted", "requeued")
#: The longest run name: a folder name most file systems take (255 bytes).
MAX_NAME_BYTES = 255
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=,+-]*")
_RESERVED = {MANIFEST, SUMMARY_JSON, SUMMARY_MD, PLOT, LOCK}


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a run's folder name inside a sweep folder, or None when it can."""
    if not isinstance(name, str):
        return f"expected a text name, got {type(name).__name__}"
    if not _NAME.fullmatch(name) or name in _RESERVED:
        return f"{name[:80]!r} is not a plain folder name (letters, digits, . _ = , + -)"
    if len(name.encode()) > MAX_NAME_BYTES:
        return f"{name[:40]!r}... is {len(name.encode())} bytes long, over the {MAX_NAME_BYTES} a folder name may have"
    return None


def check_name(name: object, where: str) -> str:
    """``name`` when it is a plain run folder name, else a :class:`UserError` ``where: why``."""
    problem = name_problem(name)
    if problem is not None:
        raise UserError(f"{where}: {problem}")
    return str(name)


def read_manifest(folder: Path) -> dict[str, Any]:
    """``folder``'s manifest, checked field by field (see :func:`check_manifest`)."""
    path = folder / MANIFEST
    if not path.exists():  # a FIFO or folder in its place: the checked read says so
        raise UserError(f"{folder}: not a sweep folder (no {MANIFEST} in it)")
    try:
        manifest = json.loads(read_input(path, "sweep manifest"))  # a FIFO planted as sweep.json: one line
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not a sweep manifest: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{path} is not a {FORMAT} manifest")
    check_manifest(manifest, str(path))
    return manifest


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """``folder``'s ``sweep.json``, written all or nothing."""
    from tlm_core.atomic import atomic_write

    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=2, allow_nan=False) + "\n")


def check_manifest(manifest: dict[str, Any], where: str) -> None:
    """Refuse a manifest whose fields are not what ``tlm sweep`` writes, in one line naming the field: ``base``
    a table, ``runs`` a list of {name, settings, status[, message]} with distinct plain names, ``jobs`` a
    positive integer. The settings' values are checked as a TrainConfig by the sweep that runs them."""
    base = manifest.get("base")
    if not isinstance(base, dict) or not isinstance(base.get("model", {}), dict):
        raise UserError(f"{where}: base must be a table of settings (model a table in it), got {_short(base)}")
    jobs = manifest.get("jobs")
    if jobs is not None and (not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1):
        raise UserError(f"{where}: jobs must be a positive integer, got {_short(jobs)}")
    runs = manifest.get("runs")
    if not isinstance(runs, list) or not runs:
        raise UserError(f"{where}: runs must be a list of one or more runs, got {_short(runs)}")
    seen: set[str] = set()
    for i, entry in enumerate(runs):
        at = f"{where}: runs[{i}]"
        if not isinstance(entry, dict):
            raise UserError(f"{at} must be a table with name, settings and status, got {_short(entry)}")
        for key in ("name", "settings", "status"):
            if key not in entry:
                raise UserError(f"{at} has no {key}")
        name = check_name(entry["name"], f"{at}.name")
        if name in seen:
            raise UserError(f"{at}.name: {name!r} is given twice")
        seen.add(name)
        settings = entry["settings"]
        if not isinstance(settings, dict):
            raise UserError(f"{at}.settings must be a table of settings, got {_short(settings)}")
        if entry["status"] not in STATUSES:
            raise UserError(f"{at}.status must be one of {', '.join(STATUSES)}, got {_short(entry['status'])}")
        if not isinstance(entry.get("message", ""), str):
            raise UserError(f"{at}.message must be text, got {_short(entry['message'])}")


def _short(value: object) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


#: The lock a SLURM task takes to rewrite ``sweep.json``.
MANIFEST_LOCK = ".manifest.lock"


@contextlib.contextmanager
def manifest_lock(folder: Path) -> Iterator[None]:
    """The lock every task takes to rewrite ``sweep.json`` (blocking ``flock``; the kernel frees it on death)."""
    fd = os.open(folder / MANIFEST_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def update_entry(folder: Path, name: str, change: dict[str, Any]) -> None:
    """Run ``name``'s entry of ``folder``'s ``sweep.json`` with ``change`` over it, under :func:`manifest_lock`."""
    with manifest_lock(folder):
        manifest = json.loads(read_input(folder / MANIFEST, "sweep manifest"))
        for entry in manifest["runs"]:
            if entry["name"] == name:
                entry.pop("message", None)
                entry.update(change)
        write_manifest(folder, manifest)
