"""Faults injected into real exporting processes, and readers racing them: save_hf replaces the folder
as one unit, from_hf reads one version of it.

A helper process imports torch once and forks one process per export (fault_processes.py); hooks in
tlm_model.interop (``_after_step``: the files of the new folder) and tlm_core.atomic (``after_step``:
the swap) log each step and can park the process there, so the test kills it with SIGKILL at a known
point. The two
exports differ in weights, RoPE θ and RMSNorm ε but not in shapes, so new weights beside an old
config.json would load without an error: only comparing against both models tells.
docs/reliability.md tabulates these cases.
"""

import dataclasses
import errno
import os
import re

import fault_processes
import pytest
import torch
from fault_processes import Saver, build

import tlm_model.interop as interop
from tlm_model import ModelConfig, save_hf
from tlm_model.interop import from_hf

pytestmark = pytest.mark.skipif(os.name != "posix", reason="SIGKILL and rename semantics are POSIX")

A = ModelConfig(vocab_size=97, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=80, num_kv_heads=2)
B = dataclasses.replace(A, rope_theta=500.0, norm_eps=1e-6)  # same shapes, another model

OLD, NEW = (1, A), (2, B)
CANDIDATES = {"old": OLD, "new": NEW}


@pytest.fixture(scope="module")
def models():
    return {label: build(*spec) for label, spec in CANDIDATES.items()}


zygote = fault_processes.zygote_fixture(
    imports="import tlm_core.atomic as atomic\nimport tlm_model.interop as interop\nfrom tlm_model import save_hf",
    hooks="interop._after_step = atomic.after_step",
    save='save_hf(model, job["target"], extra_files={"tokenizer.json": str(seed).encode()})',
)


def identify(folder, models, *, racing: bool = False) -> str:
    """Which model the export in ``folder`` holds, config, weights and extra file alike, or 'nothing'.
    While an exporter runs (``racing``), tokenizer.json is a second read of a maybe newer folder: skipped."""
    try:
        loaded = from_hf(folder)
    except FileNotFoundError:
        return "nothing"
    except OSError as err:
        # A reader that saw the folder replaced on every one of its attempts gives up with EBUSY: a clean refusal,
        # never a torn model (a save can outpace a load on a loaded machine: the writer never waits for readers).
        if racing and err.errno == errno.EBUSY:
            return "busy"
        raise
    tokenizer = None if racing else (folder / "tokenizer.json").read_bytes()
    for label, model in models.items():
        seed, config = CANDIDATES[label]
        if loaded.config == config and all(
            torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items()
        ):
            assert tokenizer in (None, str(seed).encode()), (
                f"{label}'s weights and config beside another tokenizer.json"
            )
            return label
    raise AssertionError(f"the folder holds neither export whole (config {loaded.config})")


def leftovers(parent) -> list[str]:
    temporary = re.compile(r"\.out\.\d+-[0-9a-f]{16}\.tmp")
    return sorted("temporary folder" if temporary.fullmatch(p.name) else p.name for p in parent.iterdir())


STEPS = ["weights-written", "config-written", "extra-written", "filled", "swapped", "cleaned"]
# step after which the exporter was killed -> (what loads, what the parent folder holds)
EXPECTED = {
    **{step: ("old", ["out", "temporary folder"]) for step in STEPS[:4]},  # the new folder, incomplete or not
    "swapped": ("new", ["out", "temporary folder"]),  # the old folder, under the temporary name
    "cleaned": ("new", ["out"]),
}


def test_sigkill_after_every_step_leaves_the_old_or_the_new_export(tmp_path, zygote, models):
    for step in STEPS:
        parent = tmp_path / step
        save_hf(models["old"], parent / "out", extra_files={"tokenizer.json": b"1"})
        exporter = Saver(zygote, tmp_path / f"{step}.log", parent / "out", [NEW], park_at=step)
        exporter.wait_for("parked")
        exporter.kill()
        assert (identify(parent / "out", models), leftovers(parent)) == EXPECTED[step], step
        assert sorted(p.name for p in (parent / "out").iterdir()) == [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
        ]
        # The next export removes what the killed one left, and only that.
        save_hf(models["new"], parent / "out", extra_files={"tokenizer.json": b"2"})
        assert (identify(parent / "out", models), leftovers(parent)) == ("new", ["out"]), step


def test_sigkill_of_the_first_export_leaves_no_folder(tmp_path, zygote, models):
    exporter = Saver(zygote, tmp_path / "log", tmp_path / "out", [NEW], park_at="config-written")
    exporter.wait_for("parked")
    exporter.kill()
    assert leftovers(tmp_path) == ["log", "temporary folder"]
    with pytest.raises(FileNotFoundError):
        from_hf(tmp_path / "out")


def test_a_reader_racing_an_exporter_always_loads_one_whole_export(tmp_path, zygote, models, monkeypatch):
    from tlm_model import _folder

    opened, original = [], _folder.Folder.__init__

    def counting(self, path):
        opened.append(path)
        original(self, path)

    monkeypatch.setattr(_folder.Folder, "__init__", counting)
    save_hf(models["old"], tmp_path / "out", extra_files={"tokenizer.json": b"1"})
    # The exporter alternates the two models until it is killed; the reader loads 20 times meanwhile
    # (a fixed count of reads, not of exports: on a loaded machine 40 exports took as long as 5 loads).
    exporter = Saver(zygote, tmp_path / "log", tmp_path / "out", [NEW, OLD], saves=10**6)
    exporter.wait_for("ready")
    try:
        seen = [identify(tmp_path / "out", models, racing=True) for _ in range(20)]
    finally:
        lines = exporter.kill()  # also when a read fails: a non-stop exporter must not outlive the test
    assert not [line for line in lines if line.startswith("error")] and lines.count("saved") >= 2, lines[-3:]
    assert set(seen) <= {"old", "new", "busy"} and seen.count("busy") < len(seen), seen
    assert identify(tmp_path / "out", models) in ("old", "new")
    save_hf(models["old"], tmp_path / "out", extra_files={"tokenizer.json": b"1"})  # clears the killed one's folder
    assert leftovers(tmp_path) == ["log", "out"]
    print(
        f"reader loaded 20 times during {lines.count('saved')} exports: {seen.count('old')} old, "
        f"{seen.count('new')} new, {seen.count('busy')} refused as busy; "
        f"{len(opened) - len(seen) - 1} reads started again on a replaced folder"
    )


@pytest.mark.parametrize("when, loads", [("after config.json", "new"), ("after the tensor table", "old")])
def test_a_folder_replaced_in_the_middle_of_a_read_is_read_whole(tmp_path, monkeypatch, models, when, loads):
    # Deterministic version of the race: the folder is replaced once while from_hf reads it. After
    # config.json, the old version's weights are gone: the read starts again on the new folder. After
    # every file is open, the old version is read to the end from its open files.
    save_hf(models["old"], tmp_path / "out", extra_files={"tokenizer.json": b"1"})
    replaced = []

    def replace_once():
        if not replaced:
            replaced.append(True)
            save_hf(models["new"], tmp_path / "out", extra_files={"tokenizer.json": b"2"})

    if when == "after config.json":
        original = interop.config_from_hf

        def config_from_hf(*args, **kwargs):
            config = original(*args, **kwargs)
            replace_once()
            return config

        monkeypatch.setattr(interop, "config_from_hf", config_from_hf)
        from_hf_result = from_hf(tmp_path / "out")
    else:
        from tlm_model import _weights

        original_problems = _weights.table_problems

        def table_problems(*args, **kwargs):
            replace_once()
            return original_problems(*args, **kwargs)

        monkeypatch.setattr(_weights, "table_problems", table_problems)
        from_hf_result = from_hf(tmp_path / "out")
    assert replaced
    config = CANDIDATES[loads][1]
    assert from_hf_result.config == config
    assert all(torch.equal(from_hf_result.state_dict()[k], v) for k, v in models[loads].state_dict().items())
