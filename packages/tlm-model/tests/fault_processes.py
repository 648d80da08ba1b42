"""Real processes to kill: the harness test_checkpoint_faults.py and test_interop_faults.py share.

A *zygote* is one ``python`` process that imports torch once and then forks a fresh worker per job
read from its stdin (the fork is the process a test kills): 30 workers cost one interpreter start,
not 30. Each worker logs a line per step through the module hooks the test names
(``tlm_model.checkpoint._after_step``, ``tlm_core.atomic.after_step``, ...), and parks at the step
``park_at`` names, so that the test can SIGKILL it at a known point. ``Saver`` is the test's handle on
one fork. Every worker is a saver (:class:`Saver`): it builds its job's models, logs "ready", then saves them
in turn, logging "saved" after each. The conftest beside this file puts this folder on ``sys.path`` (pytest
runs in importlib mode).
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM

_ZYGOTE = r"""
import json, os, signal, sys, time, torch
from fault_processes import build  # the test's own recipe: the same seed gives the same weights
from tlm_model import ModelConfig
{imports}

torch.set_num_threads(1)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the forks

for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid:
        print(pid, flush=True)
        continue
    log = open(job["log"], "w", buffering=1)  # one write(2) per line: a kill loses none

    def step(name):
        log.write(name + "\n")
        if name == job["park_at"]:
            log.write("parked\n")
            time.sleep(3600)

    {hooks} = step
    code = 1
    try:
        models = [(build(seed, ModelConfig(**config)), seed) for seed, config in job["models"]]
        log.write("ready\n")
        for i in range(job["saves"]):
            model, seed = models[i % len(models)]
            {save}
            log.write("saved\n")
        log.write("done\n")
        code = 0
    except BaseException as err:
        log.write(f"error {{err!r}}\n")
    finally:
        os._exit(code)
"""


def build(seed: int, config: ModelConfig) -> TransformerLM:
    """The model built from ``seed``, in the test and in its workers alike. Norm gains are drawn away
    from 1, so that weights saved beside another model's config would show."""
    torch.manual_seed(seed)
    model = TransformerLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name:
                p.uniform_(0.5, 1.5)
    return model


def zygote_fixture(imports: str, hooks: str, save: str) -> Any:
    """A module-scoped fixture that runs one zygote (``zygote = zygote_fixture(...)`` in a test module).
    ``imports``: the modules ``save`` uses; ``hooks``: the step hooks to set, ``a = b`` style; ``save``: one
    statement that saves ``model`` (built from ``seed``) to ``job["target"]``."""

    @pytest.fixture(scope="module")
    def zygote() -> Iterator[subprocess.Popen]:
        yield from _zygote(imports, hooks, save)

    return zygote


def _zygote(imports: str, hooks: str, save: str) -> Iterator[subprocess.Popen]:
    source = _ZYGOTE.format(imports=imports, hooks=hooks, save=save)
    path = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}  # the workers import build from here
    proc = subprocess.Popen([sys.executable, "-c", source], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


class Saver:
    """One forked worker that saves ``models`` ((seed, ModelConfig) pairs) in turn ``saves`` times into
    ``target``, parked after the step ``park_at`` names."""

    def __init__(self, zygote: subprocess.Popen, log, target, models, saves: int = 1, park_at: str = ""):
        self.log = log
        job = {"target": str(target), "models": [(seed, c.to_dict()) for seed, c in models], "saves": saves}
        zygote.stdin.write(json.dumps({**job, "log": str(log), "park_at": park_at}) + "\n")
        zygote.stdin.flush()
        self.pid = int(zygote.stdout.readline())

    def lines(self) -> list[str]:
        return self.log.read_text().split("\n")[:-1] if self.log.exists() else []

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def wait_for(self, line: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while line not in self.lines():
            assert not any(x.startswith("error") for x in self.lines()), self.lines()
            assert time.monotonic() < deadline and (self.alive() or line in self.lines()), (line, self.lines())
            time.sleep(0.01)

    def kill(self) -> list[str]:
        """SIGKILL the worker, wait until it is gone, and return its log."""
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while self.alive():
            assert time.monotonic() < deadline, "the killed process did not go away"
            time.sleep(0.01)
        return self.lines()
