"""The noxfile's main job (``nox -s train``): its reused venv is installed into only when what it needs changed, and
a signal to nox stops the ``tlm train`` it runs (a real nox, a real ``tlm train``, a real SIGTERM)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

NOXFILE = Path(__file__).resolve().parents[3] / "noxfile.py"
pytestmark = pytest.mark.skipif(not NOXFILE.is_file(), reason="the tlm monorepo's noxfile is not beside this copy")


@pytest.fixture(scope="module")
def noxfile():
    pytest.importorskip("nox", reason="the workspace's test sessions install nox (TEST_REQUIREMENTS)")
    spec = importlib.util.spec_from_file_location("tlm_noxfile_under_test", NOXFILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Session:
    """What ``_install_once`` uses of a nox session: the venv's folder, install and log."""

    def __init__(self, location):
        self.virtualenv = SimpleNamespace(location=str(location))
        self.installs, self.logs = [], []

    def install(self, *args):
        self.installs.append(args)

    def log(self, line):
        self.logs.append(line)


def test_a_reused_venv_is_installed_into_once_until_a_pyproject_or_the_arguments_change(noxfile, tmp_path, monkeypatch):
    session = _Session(tmp_path)
    noxfile._install_once(session, "-e", "packages/tlm-command[plot]")
    noxfile._install_once(session, "-e", "packages/tlm-command[plot]")
    assert len(session.installs) == 1 and "nothing to install" in session.logs[-1]
    noxfile._install_once(session, "-e", "packages/tlm-command")  # other arguments
    assert len(session.installs) == 2
    # A requirement added to a workspace pyproject.toml installs again (read through the PACKAGES table).
    meta = dict(noxfile.PACKAGES["tlm-core"])
    fake = tmp_path / "tlm-core"
    fake.mkdir()
    (fake / "pyproject.toml").write_text((meta["dir"] / "pyproject.toml").read_text() + "\n# changed\n")
    monkeypatch.setitem(noxfile.PACKAGES, "tlm-core", {**meta, "dir": fake})
    noxfile._install_once(session, "-e", "packages/tlm-command")
    assert len(session.installs) == 3
    assert session.installs[0][-2:] == ("-e", "packages/tlm-command[plot]")  # with the torch pin before them


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow  # a nox process and a tlm train under it: seconds
def test_sigterm_to_nox_stops_its_tlm_train_which_checkpoints(noxfile, tmp_path):
    run = tmp_path / "run"
    text = tmp_path / "text.txt"
    from tlm_train import default_corpus

    text.write_text(default_corpus()[:20_000], encoding="utf-8")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    # The real session with the venv this test runs in (--no-venv --no-install): `tlm` is on PATH.
    argv = [sys.executable, "-m", "nox", "-f", str(NOXFILE), "-s", "train", "--no-venv", "--no-install", "--",
            "--out-dir", str(run), "--data", str(text), "--vocab-size", "260", "--steps", "1000000",
            "--context-length", "16", "--d-model", "16", "--num-layers", "1", "--num-heads", "2", "--d-ff", "32",
            "--batch-size", "2", "--eval-interval", "1000000", "--sample-tokens", "0",
            "--peak-flops", "1e9"]  # fmt: skip
    nox = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True)  # fmt: skip
    child = None
    try:
        deadline = time.monotonic() + 240
        while child is None or not any("train_loss" in line for line in _lines(run / "metrics.jsonl")):
            assert nox.poll() is None and time.monotonic() < deadline, nox.stdout.read().decode()[-3000:]
            time.sleep(0.2)
            if child is None and (run / ".lock").is_file() and (run / ".lock").read_text():
                child = json.loads((run / ".lock").read_text())["pid"]  # the process training (tlm train's lock)
        assert child != nox.pid and _alive(child)
        os.kill(nox.pid, signal.SIGTERM)
        output = nox.communicate(timeout=180)[0].decode()
        for _ in range(100):  # the child is nox's: gone by the time nox exits, or reaped just after
            if not _alive(child):
                break
            time.sleep(0.1)
        assert not _alive(child), output[-3000:]
        assert nox.returncode != 0
        assert list((run / "checkpoints").glob("step_*")), output[-3000:]  # it stopped as tlm train stops: checkpointed
    finally:
        for pid in (child, nox.pid):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        nox.wait(timeout=30)


def _lines(path):
    return path.read_text().splitlines() if path.is_file() else []


class _LegSession(_Session):
    """What ``_slurm_beside`` uses of a nox session when SLURM cannot be had: warn."""

    def __init__(self, location):
        super().__init__(location)
        self.warnings = []

    def warn(self, line):
        self.warnings.append(line)


class _NoSlurm:
    @staticmethod
    def unavailable():
        return "only root can start SLURM's daemons (and apt-get install slurm-wlm munge when absent)"


def test_where_slurm_cannot_be_had_the_slurm_leg_is_skipped_saying_why_outside_ci_only(noxfile, tmp_path, monkeypatch):
    monkeypatch.setattr(noxfile, "_slurm_local", lambda: _NoSlurm)
    started = []
    monkeypatch.setattr(noxfile.subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail("a leg started"))
    for value in ("", "0", "false"):
        monkeypatch.setenv("CI", value)
        session, ran = _LegSession(tmp_path), []
        with noxfile._slurm_beside(session):
            ran.append(True)  # the suite still runs
        assert ran and not started and "do not run: only root can start" in session.warnings[0]
    for value in ("true", "1"):
        monkeypatch.setenv("CI", value)
        assert noxfile._in_ci()
    # In CI the leg is not skipped: it runs (and fails, saying why); here it would start a process.
    monkeypatch.setenv("CI", "true")
    session = _LegSession(tmp_path)
    session.create_tmp = lambda: str(tmp_path)
    session.bin, session.env = str(tmp_path), {}
    with pytest.raises(pytest.fail.Exception, match="a leg started"), noxfile._slurm_beside(session):
        pass
    assert started and not session.warnings
