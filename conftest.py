"""Shared pytest fixtures for every package's tests and for tests-course.

``TLM_TEST_DEVICE`` (default ``cpu``) picks the device the ``device`` fixture returns; the
nox ``tests`` session sets it to ``cuda`` for the CUDA leg of the matrix.
"""

import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest
import torch


def _device_name() -> str:
    return os.environ.get("TLM_TEST_DEVICE", "cpu")


def pytest_report_header(config: pytest.Config) -> str:
    checked = ", ".join(_jaxtyping_packages(config)) or "off"
    return f"tlm: TLM_TEST_DEVICE={_device_name()}, torch {torch.__version__}, jaxtyping runtime checks: {checked}"


# jaxtyping's runtime checks: `nox -s tests` passes --jaxtyping-packages=<every tlm package>,tlm_typecheck.typechecker
# (jaxtyping's pytest plugin; the checker is beartype, tools/tlm_typecheck.py), so every annotated call a
# test makes is checked against its annotations, shapes included.
# Inside pytest.raises the checks are paused: there a test probes our own validation, which is what users
# get without the hook, and jaxtyping would otherwise answer first with its own message. They also pause
# while torch.compile traces (tools/tlm_typecheck.py says why).
def _jaxtyping_packages(config: pytest.Config) -> list[str]:
    value = config.getoption("jaxtyping_packages", default=None) or ""
    return [name.strip() for name in value.split(",")[:-1]]  # the last entry is the type checker


def pytest_configure(config: pytest.Config) -> None:
    if not _jaxtyping_packages(config):
        return
    import tlm_typecheck  # tools/, on pytest's pythonpath

    tlm_typecheck.install()  # checks pause while torch.compile traces
    original = pytest.raises

    @functools.wraps(original)
    def raises(*args, **kwargs):
        if len(args) > 1:  # pytest.raises(exc, func, *args): call func with the checks paused
            with tlm_typecheck.Paused(original(args[0], **kwargs)) as info:
                args[1](*args[2:])
            return info
        return tlm_typecheck.Paused(original(*args, **kwargs))

    pytest.raises = raises
    config.add_cleanup(lambda: setattr(pytest, "raises", original))


@pytest.fixture
def shape_checks(request: pytest.FixtureRequest) -> Callable[[ModuleType, Callable[[], object]], None]:
    """``shape_checks(module, call)``: ``call()`` must raise jaxtyping's TypeCheckError. Fails when the run
    asked for jaxtyping's checks on ``module``'s package but the module was imported without them; skips,
    saying so, when the run did not ask (plain pytest)."""

    def check(module: ModuleType, call: Callable[[], object]) -> None:
        requested = module.__name__.split(".")[0] in _jaxtyping_packages(request.config)
        instrumented = type(getattr(module.__spec__, "loader", None)).__name__ == "_JaxtypingLoader"
        if requested != instrumented:
            pytest.fail(f"jaxtyping checks requested for {module.__name__}: {requested}, installed: {instrumented}")
        if not requested:
            pytest.skip("jaxtyping's runtime checks are off in this run (nox -s tests turns them on)")
        from jaxtyping import TypeCheckError

        try:
            call()
        except TypeCheckError:
            return
        pytest.fail(f"a wrong-shaped call into {module.__name__} passed jaxtyping's checks")

    return check


# The test files that take longest (the per-file seconds of full `nox -s tests` runs' JUnit XML), heaviest first.
# `nox -s tests` deals whole files to its xdist workers in collection order (--no-loadscope-reorder: xdist's
# default order, most tests first, put these few-test files last); begun first, they end before the many short
# files do, so no worker is left idle while another runs one of them at the end.
HEAVY_FIRST = (
    "packages/tlm-model/tests/test_inference.py",
    "packages/tlm-command/tests/test_readme_tools.py",
    "packages/tlm-command/tests/test_serve_compiles.py",
    "packages/tlm-model/tests/test_scheduler_compiles.py",
    "packages/tlm-model/tests/test_compile.py",
    "packages/tlm-train/tests/test_distributed.py",
    "packages/tlm-train/tests/test_recipe.py",
    "packages/tlm-attention/tests/test_kv_cache.py",
    "packages/tlm-model/tests/test_generate.py",
    "packages/tlm-train/tests/test_checkpoint.py",
    "packages/tlm-command/tests/test_serve_api.py",
    "packages/tlm-command/tests/test_sweep.py",
    "packages/tlm-train/tests/test_gpu_check.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files of HEAVY_FIRST first, in its order; every other test after them as collected (a stable sort:
    each file's tests keep their order)."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}

    def key(item: pytest.Item) -> int:
        try:
            return rank.get(item.path.relative_to(config.rootpath).as_posix(), len(rank))
        except ValueError:  # a test outside the repository
            return len(rank)

    items.sort(key=key)


@pytest.fixture
def device() -> torch.device:
    name = _device_name()
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"TLM_TEST_DEVICE={name} but torch.cuda.is_available() is False")
    return torch.device(name)


@pytest.fixture(autouse=True)
def _seed() -> None:
    # Every test starts from the same RNG state, whatever ran before it.
    torch.manual_seed(0)


def _rope_by_complex_multiplication(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Independent RoPE reference in float64: pair (x[2k], x[2k+1]) is the complex number
    x[2k] + i·x[2k+1], and rotating it by θ_{i,k} = i·Θ^(-2k/d) is multiplying by e^{iθ}."""
    d = x.shape[-1]
    k = torch.arange(d // 2, dtype=torch.float64, device=x.device)
    angles = positions.to(torch.float64).unsqueeze(-1) * theta ** (-2.0 * k / d)
    z = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).reshape(x.shape)


@pytest.fixture
def rope_reference():
    """The complex-multiplication RoPE reference: ``rope_reference(x, positions, theta)``."""
    return _rope_by_complex_multiplication


_LARGEST_ERRORS: dict[str, tuple[float, float]] = {}


@pytest.fixture
def record_error():
    """``record_error(label, actual, expected)`` keeps the largest absolute and relative error
    seen per label; the terminal summary prints them, so reports quote measured numbers."""

    def record(label: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        diff = (actual.detach().double() - expected.detach().double()).abs()
        absolute = diff.max().item() if diff.numel() else 0.0
        # Normwise: relative to the largest reference magnitude, so entries near 0 do not explode it.
        peak = expected.detach().double().abs().max().item() if diff.numel() else 0.0
        relative = absolute / peak if peak > 0 else 0.0
        old_abs, old_rel = _LARGEST_ERRORS.get(label, (0.0, 0.0))
        _LARGEST_ERRORS[label] = (max(old_abs, absolute), max(old_rel, relative))

    return record


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _LARGEST_ERRORS:
        return
    terminalreporter.section("largest error against each independent reference")
    width = max(map(len, _LARGEST_ERRORS))
    for label, (absolute, relative) in sorted(_LARGEST_ERRORS.items()):
        terminalreporter.write_line(
            f"{label:<{width}}  max |err| {absolute:.2e}   max |err| / max |ref| {relative:.2e}"
        )


# Hypothesis profiles for the property-based tests (those decorated with @given). Only packages whose
# `test` extra lists hypothesis have it installed, so the others' suites must not need it here.
try:
    from hypothesis import settings
except ImportError:  # pragma: no cover - e.g. the tlm-linear or tests-course venv
    pass
else:
    # "ci", the default: a bounded, reproducible run (derandomize draws the same examples every
    # time, and needs no example database); each property takes well under 2 s on a 2-core CPU.
    settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, print_blob=True)
    # "thorough": `pytest --hypothesis-profile=thorough` (the option comes from hypothesis' pytest
    # plugin, which loads the profile after this file has loaded "ci"). Random examples each run;
    # a failure prints a @reproduce_failure blob. No database, so no .hypothesis/ appears.
    settings.register_profile("thorough", max_examples=500, deadline=None, database=None, print_blob=True)
    settings.load_profile("ci")


_ORDERED_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of the (shared) dtype lie between a and b: 0 equal, 1 adjacent."""
    assert a.dtype == b.dtype
    int_dtype, magnitude = _ORDERED_BITS[a.dtype]

    def ordered(t: torch.Tensor) -> torch.Tensor:
        # Sign-magnitude bit patterns to integers in the order of the floats (+0 and -0 both 0).
        i = t.contiguous().view(int_dtype).long()
        return torch.where(i < 0, -(i & magnitude), i)

    return (ordered(a) - ordered(b)).abs()


@pytest.fixture
def ulp_distance():
    """``ulp_distance(a, b)``: elementwise distance in units in the last place of their dtype."""
    return _ulp_distance


class _HostReads:
    """Counts the reads of tensor values back to the host while active: ``aten::_local_scalar_dense``
    (what ``.item()``, ``int(t)``, ``bool(t)`` dispatch to) seen by a ``TorchDispatchMode``, and the
    Python-level ``Tensor.item``/``tolist``/``__bool__``/``__int__``/``__float__``/``__index__`` calls and
    ``Tensor.numpy``, seen by a ``TorchFunctionMode`` (``tolist`` of a CPU tensor reads memory without
    dispatching). On an accelerator each of these waits for the device."""

    _PYTHON_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"})

    def __init__(self) -> None:
        self.reads: list[str] = []

    def __enter__(self) -> "list[str]":
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self.reads

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func is torch.ops.aten._local_scalar_dense.default:
                    reads.append(str(func))
                return func(*args, **(kwargs or {}))

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                name = getattr(func, "__name__", "")
                if name in _HostReads._PYTHON_READS:
                    reads.append(f"Tensor.{name}")
                return func(*args, **(kwargs or {}))

        self._modes = (Function(), Dispatch())
        for mode in self._modes:
            mode.__enter__()
        return reads

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


@pytest.fixture
def host_reads() -> Callable[[], _HostReads]:
    """``with host_reads() as reads: ...``: ``reads`` lists every read of a tensor value back to the host
    (``aten::_local_scalar_dense`` and ``Tensor.item``/``tolist``/``bool``/...) made inside the block."""
    return _HostReads


@pytest.fixture
def recorded_graphs(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Inference compiles through a backend that records each graph dynamo hands it and runs it as traced (no C++
    build); dynamo is reset first. The list the graphs go to (tlm-model's scheduler tests, tlm serve's)."""
    import torch._dynamo

    from tlm_model import inference

    graphs: list[object] = []

    def backend(graph_module: Any, example_inputs: object) -> Any:
        graphs.append(graph_module)
        return graph_module.forward

    monkeypatch.setitem(inference.DECODE_COMPILE_KWARGS, "cpu", {"backend": backend, "fullgraph": True,
                                                                  "dynamic": False})  # fmt: skip
    monkeypatch.setattr(inference, "PREFILL_COMPILE_KWARGS", {"backend": backend, "fullgraph": True})
    torch._dynamo.reset()
    return graphs


class _NotAFile:
    """What the checked-read tests put in place of an input file, and how they call its reader."""

    KIND: ClassVar[dict[str, str]] = {"fifo": "a FIFO (named pipe)", "folder": "a folder"}

    @staticmethod
    def plant(path: Path, kind: str) -> Path:
        """A FIFO with no writer (a plain ``open`` would wait on it for ever) or a folder at ``path``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "fifo":
            os.mkfifo(path)
        else:
            path.mkdir()
        return path

    @staticmethod
    def raised(call: Callable[[], object]) -> BaseException | None:
        """The exception ``call()`` raised, run in a thread that must end within 10 s: a reader that blocks on a
        FIFO fails the test instead of hanging it."""
        outcome: dict[str, BaseException] = {}

        def run() -> None:
            try:
                call()
            except Exception as err:
                outcome["error"] = err

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "the read blocked"
        return outcome.get("error")

    @classmethod
    def refused(cls, call: Callable[[], object], what: str, path: Path, kind: str) -> None:
        """``call()`` raises the checked open's one ValueError naming ``what`` and ``path``."""
        error = cls.raised(call)
        assert isinstance(error, ValueError), repr(error)
        assert str(error) == f"{what} {path}: {cls.KIND[kind]}, expected a regular file"


@pytest.fixture
def not_a_file() -> type[_NotAFile]:
    """``not_a_file.plant(path, "fifo" | "folder")``, ``not_a_file.raised(call)``,
    ``not_a_file.refused(call, what, path, kind)``: the checked reads' tests in every package."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    return _NotAFile


@pytest.fixture
def hand_run() -> Callable[..., object]:
    """``hand_run(folder, records, **settings)``: a run folder as ``tlm train`` leaves it, written by hand (4 steps
    of a tiny model, ``train.toml`` with the resolved model, ``metrics.jsonl`` of ``records``); returns its
    TrainConfig. The run readers' tests in tlm-experiments and tlm-command."""
    import json

    from tlm_train import TrainConfig

    tiny = {"context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64}

    def write(folder: Path, records: list[dict], **settings: object) -> TrainConfig:
        config = TrainConfig(out_dir=str(folder), vocab_size=32, steps=4, model=tiny, **settings)
        folder.mkdir(parents=True)
        config = config.replace(model=config.model_config(32).to_dict(drop_none=True))
        (folder / "train.toml").write_text(config.to_toml())
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return config

    return write


# ---------------------------------------------------------------------------------------------
# Processes to kill, started by fork from a warm interpreter


_FORK_SERVER = r"""
import ctypes, json, os, signal, sys, traceback
{imports}

# The parent's death kills this process (and, set again in each fork, the processes below it).
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)


def orphan_dies():
    if _prctl is not None:
        _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)


orphan_dies()
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the monitors
for line in sys.stdin:
    job = json.loads(line)
    if os.fork():
        continue
    # The monitor: forks the job's process, says its pid, waits for it and records how it ended.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    orphan_dies()
    pid = os.fork()
    if pid == 0:
        orphan_dies()
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        sys.stdin = open(os.devnull)  # not the server's, which may have read ahead the jobs after this one
        for fd, name in ((1, "stdout"), (2, "stderr")):
            out = os.open(job[name], os.O_WRONLY)  # made empty by the test
            os.dup2(out, fd)
            os.close(out)
        os.environ.update(job["env"])
        sys.argv = ["-c", *job["args"]]
        code = 0
        try:
            exec(compile(job["code"], "<string>", "exec"), {{"__name__": "__main__"}})
        except SystemExit as exit:
            if exit.code is None or isinstance(exit.code, int):
                code = exit.code or 0
            else:
                print(exit.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.write(1, f"{{pid}}\n".encode())
    _, status = os.waitpid(pid, 0)
    with open(job["status"] + ".tmp", "w") as file:
        file.write(str(os.waitstatus_to_exitcode(status)))
    os.replace(job["status"] + ".tmp", job["status"])
    os._exit(0)
"""


class _Output:
    """A forked process's stdout or stderr, read from the file it writes while it runs."""

    def __init__(self, path: str, process: "Forked") -> None:
        self._path, self._process, self._at = path, process, 0

    def _text(self) -> str:
        with open(self._path, encoding="utf-8", errors="replace") as file:
            return file.read()

    def readline(self) -> str:
        """The next whole line, once the process wrote it ("" when it ended without one), like a pipe's."""
        import time

        while True:
            ended = self._process.poll() is not None  # before reading: what an ended process wrote is all there
            text = self._text()[self._at :]
            if "\n" in text or ended:
                line = text[: text.index("\n") + 1] if "\n" in text else text
                self._at += len(line)
                return line
            time.sleep(0.005)

    def read(self) -> str:
        """Everything not yet read, once the process has ended."""
        self._process.wait()
        text = self._text()[self._at :]
        self._at += len(text)
        return text


class Forked:
    """A process forked from a warm interpreter, with the parts of subprocess.Popen's interface the tests use."""

    def __init__(self, server, folder: str, code: str, args: list[str], env: dict[str, str]) -> None:
        import json

        self._status = os.path.join(folder, "status")
        job = {"code": code, "args": args, "env": env, "status": self._status}
        job |= {name: os.path.join(folder, name) for name in ("stdout", "stderr")}
        for name in ("stdout", "stderr"):
            open(job[name], "x").close()
        try:
            server.stdin.write(json.dumps(job) + "\n")
            server.stdin.flush()
            self.pid = int(server.stdout.readline())
        except (OSError, ValueError):
            raise RuntimeError(f"the fork server ended (exit status {server.wait()}): see its stderr above") from None
        self.returncode: int | None = None
        self.stdout, self.stderr = _Output(job["stdout"], self), _Output(job["stderr"], self)

    def poll(self) -> int | None:
        if self.returncode is None and os.path.exists(self._status):
            with open(self._status) as file:
                self.returncode = int(file.read())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout.read(), self.stderr.read()

    def send_signal(self, sig: int) -> None:
        # As subprocess.Popen's: a process that ended (and was reaped by the fork server) after the poll is not
        # an error; the ended process's status is what the caller reads next.
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


@pytest.fixture(scope="session")
def fork_server(tmp_path_factory: pytest.TempPathFactory):
    """``fork_server(imports)`` -> ``start(code, *args, wait=True)``: run ``code`` as ``python -c code *args``
    would, in a process forked from an interpreter that has already run ``imports`` (one server per
    ``imports`` in each pytest process). Importing torch takes seconds on a busy machine; a fork takes
    milliseconds, so a test that kills many processes pays for one interpreter start, not one per process.
    ``env`` adds to the process's environment. ``wait=True`` returns (returncode, stdout, stderr) once the
    process ended; ``wait=False`` a ``Forked``,
    which the test signals, kills and waits for like a ``subprocess.Popen`` (stdout/stderr are always
    captured: ``.stdout.readline()``, ``.communicate()``). The processes run with one thread
    (OMP_NUM_THREADS=1) and die with the server, which dies with the test's process."""
    import subprocess
    import sys
    import types

    servers: dict[str, subprocess.Popen] = {}

    def server_for(imports: str) -> "Callable[..., object]":
        if imports not in servers:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
            servers[imports] = subprocess.Popen([sys.executable, "-c", _FORK_SERVER.format(imports=imports)], env=env,
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip

        def start(code: str, *args: str, wait: bool = True, timeout: float = 600, env: dict[str, str] | None = None):
            import textwrap

            folder = tmp_path_factory.mktemp("forked")
            process = Forked(servers[imports], str(folder), textwrap.dedent(code), [str(a) for a in args], env or {})
            if not wait:
                return process
            try:
                out, err = process.communicate(timeout=timeout)
            finally:
                process.kill()
            return types.SimpleNamespace(returncode=process.returncode, stdout=out, stderr=err)

        return start

    yield server_for
    for server in servers.values():
        try:
            server.stdin.close()
        except OSError:  # it ended already (a failure that a test reported)
            pass
        server.wait(timeout=60)
