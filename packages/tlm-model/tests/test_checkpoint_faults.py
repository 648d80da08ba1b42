"""Faults injected into a real saving process: SIGKILL at every step, at random times, and races.

Each test forks ``python`` processes that call ``save_model_file`` (fault_processes.py); a hook in
``tlm_model.checkpoint`` logs every step the save completes, and can park the process there so
the test kills it with SIGKILL at a known point. After the kill the test looks at what is on disk
and loads it: the result must be the old checkpoint or the new one, bit for bit, never a mix.
docs/reliability.md tabulates these cases.
"""

import os
import random
import re
import time

import fault_processes
import pytest
import torch
from fault_processes import Saver, build

from tlm_model import ModelConfig, TransformerLM, load_model_file, save_model_file

# Not marked slow though every test starts and kills python processes (seconds in all): what they show, the
# old file or the new after a SIGKILL, is a promise every checkpoint write makes.
pytestmark = pytest.mark.skipif(os.name != "posix", reason="SIGKILL and rename-over semantics are POSIX")

SMALL = ModelConfig(vocab_size=97, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=80)
# Big enough (about 4 MB) that a save takes a while, so random kills land inside it.
MEDIUM = ModelConfig(vocab_size=4000, context_length=32, d_model=128, num_layers=2, num_heads=4, d_ff=344)


zygote = fault_processes.zygote_fixture(
    imports="import tlm_model.checkpoint as checkpoint\nfrom tlm_model import save_model_file",
    hooks="checkpoint._after_step",
    save='save_model_file(model, job["target"])',
)


def identify(directory, candidates: dict[str, TransformerLM]) -> str:
    """Which candidate the checkpoint in ``directory`` holds, bit for bit, or 'nothing'."""
    try:
        loaded = load_model_file(directory).state_dict()
    except FileNotFoundError:
        return "nothing"
    for label, model in candidates.items():
        if all(torch.equal(loaded[k], v) for k, v in model.state_dict().items()):
            return label
    raise AssertionError("the checkpoint holds neither the old nor the new model")


def on_disk(directory) -> list[str]:
    temporary = re.compile(r"\.model\.safetensors\.\d+-[0-9a-f]{16}\.tmp")
    return sorted("temporary file" if temporary.fullmatch(p.name) else p.name for p in directory.iterdir())


STEPS = ["temp-created", "written", "replaced"]
OLD, NEW = 1, 2
# (what the folder held before, step after which the saver was killed) -> (files afterwards, what loads)
EXPECTED = {
    **{("empty", s): (["temporary file"], "nothing") for s in STEPS[:2]},
    ("empty", "replaced"): (["model.safetensors"], "new"),
    **{("current", s): (["model.safetensors", "temporary file"], "old") for s in STEPS[:2]},
    ("current", "replaced"): (["model.safetensors"], "new"),
}


def prepare(directory, before: str) -> None:
    directory.mkdir()
    if before == "current":
        save_model_file(build(OLD, SMALL), directory)


@pytest.mark.parametrize("before", ["empty", "current"])
def test_sigkill_after_every_step_leaves_the_old_or_the_new_checkpoint(tmp_path, zygote, before):
    candidates = {"old": build(OLD, SMALL), "new": build(NEW, SMALL)}
    for step in STEPS:
        directory = tmp_path / step
        prepare(directory, before)
        saver = Saver(zygote, tmp_path / f"{step}.log", directory, [(NEW, SMALL)], park_at=step)
        saver.wait_for("parked")
        saver.kill()
        assert (on_disk(directory), identify(directory, candidates)) == EXPECTED[before, step], step


def test_sigkill_at_random_times(tmp_path, zygote):
    # Each process saves the two models in turn over a checkpoint of the first and dies at a random
    # moment; the step it last logged says where the kill landed (the next one had not finished).
    rng = random.Random(0)
    candidates = {"A": build(10, MEDIUM), "B": build(11, MEDIUM)}
    landed = []
    for trial in range(12):
        directory = tmp_path / str(trial)
        save_model_file(candidates["A"], directory)
        saver = Saver(zygote, tmp_path / f"{trial}.log", directory, [(11, MEDIUM), (10, MEDIUM)], saves=1000)
        saver.wait_for("ready")
        time.sleep(rng.uniform(0.0, 0.3))
        log = saver.kill()
        assert "done" not in log, "the kill came too late to interrupt anything"
        landed.append(f"{log.count('saved')} saves + {log[-1]}")
        assert identify(directory, candidates) in ("A", "B")
        assert set(on_disk(directory)) <= {"model.safetensors", "temporary file"}
    print("random kills landed after:", landed)


def test_two_savers_and_a_reader_race(tmp_path, zygote):
    a, b = build(20, SMALL), build(21, SMALL)
    save_model_file(a, tmp_path / "ckpt")
    savers = [Saver(zygote, tmp_path / f"{s}.log", tmp_path / "ckpt", [(s, SMALL)], saves=40) for s in (20, 21)]
    seen = []
    while any(s.alive() for s in savers):
        seen.append(identify(tmp_path / "ckpt", {"A": a, "B": b}))
    for saver in savers:
        assert saver.lines()[-1] == "done" and saver.lines().count("saved") == 40, saver.lines()[-3:]
    assert identify(tmp_path / "ckpt", {"A": a, "B": b}) in ("A", "B")
    assert on_disk(tmp_path / "ckpt") == ["model.safetensors"]  # every temporary file was renamed in
    assert set(seen) <= {"A", "B"}
    print(f"reader loaded {len(seen)} times during 80 saves: {seen.count('A')} A, {seen.count('B')} B")
