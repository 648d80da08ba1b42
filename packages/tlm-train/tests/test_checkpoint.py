"""The training-state format (train_state.pt), the course's save_checkpoint / load_checkpoint over it, and
step folders (CheckpointManager): round trips, all-or-nothing writes, refusal of damaged or mixed files."""

import io
import os
import shutil

import pytest
import torch
from torch import nn

from tlm_model import ModelConfig, TransformerLM, load_model_file
from tlm_optim import AdamW, CosineSchedule
from tlm_train import (
    CheckpointManager,
    capture_state,
    load_checkpoint,
    read_checkpoint,
    restore_state,
    rng_state,
    save_checkpoint,
)


def _trained(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
    return model, opt


def _same_state(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("kind", ["path", "str", "file"])
def test_round_trip(tmp_path, kind):
    model, opt = _trained(0)
    fresh_model, fresh_opt = _trained(1)
    sched = CosineSchedule(opt, 1e-2, 1e-3, 2, 10)
    target = {"path": tmp_path / "ck.pt", "str": str(tmp_path / "ck.pt"), "file": io.BytesIO()}[kind]
    save_checkpoint(model, opt, 17, target, scheduler=sched.state_dict(), rng=rng_state(), note="x")
    if kind == "file":
        target.seek(0)
    assert load_checkpoint(target, fresh_model, fresh_opt) == 17
    assert _same_state(model.state_dict(), fresh_model.state_dict())
    assert _same_state(opt.state_dict(), fresh_opt.state_dict())
    if kind == "file":
        target.seek(0)
    extra = read_checkpoint(target)["extra"]
    assert extra["note"] == "x" and extra["scheduler"]["last_epoch"] == sched.last_epoch


def test_works_with_torch_optimizers(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    save_checkpoint(model, opt, 1, tmp_path / "sgd.pt")
    other = nn.Linear(3, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    assert load_checkpoint(tmp_path / "sgd.pt", other, other_opt) == 1
    assert _same_state(opt.state_dict(), other_opt.state_dict())


def test_file_is_a_plain_weights_only_torch_file(tmp_path):
    model, opt = _trained()
    save_checkpoint(model, opt, 3, tmp_path / "ck.pt", rng=rng_state())
    payload = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert payload["step"] == 3 and payload["format"] == "tlm-train-state/2"
    assert "digest" not in payload  # one hash per file: the trailer's SHA-256 of its bytes (issue 43)
    assert set(payload["model"]) == set(model.state_dict())


def test_no_temporary_files_left_and_old_file_replaced(tmp_path):
    model, opt = _trained()
    for i in range(3):
        save_checkpoint(model, opt, i, tmp_path / "ck.pt")
    assert os.listdir(tmp_path) == ["ck.pt"]
    assert read_checkpoint(tmp_path / "ck.pt")["step"] == 2


def test_failed_save_keeps_the_old_checkpoint(tmp_path):
    model, opt = _trained()
    save_checkpoint(model, opt, 1, tmp_path / "ck.pt")
    with pytest.raises(TypeError, match=r"extra\]\['bad'\]|extra'\]\['bad'\]"):
        save_checkpoint(model, opt, 2, tmp_path / "ck.pt", bad=object())
    assert read_checkpoint(tmp_path / "ck.pt")["step"] == 1
    assert os.listdir(tmp_path) == ["ck.pt"]


def test_error_while_writing_removes_the_temporary_file(tmp_path, monkeypatch):
    model, opt = _trained()
    save_checkpoint(model, opt, 1, tmp_path / "ck.pt")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(model, opt, 2, tmp_path / "ck.pt")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ck.pt"]
    assert read_checkpoint(tmp_path / "ck.pt")["step"] == 1


def test_symlink_at_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    import tlm_core.atomic

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    trap = tmp_path / f".ck.pt.{os.getpid()}-{'a' * 16}.tmp"
    trap.symlink_to(victim)
    names = iter(["a" * 16, "b" * 16])
    monkeypatch.setattr(tlm_core.atomic.secrets, "token_hex", lambda n: next(names))
    model, opt = _trained()
    save_checkpoint(model, opt, 1, tmp_path / "ck.pt")
    assert victim.read_text() == "keep me" and trap.is_symlink()
    assert read_checkpoint(tmp_path / "ck.pt")["step"] == 1


def test_truncated_file_refused_with_its_name(tmp_path):
    model, opt = _trained()
    path = tmp_path / "ck.pt"
    save_checkpoint(model, opt, 1, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="ck.pt is not a tlm-train-state/2 file .truncated"):
        load_checkpoint(path, model, opt)


def test_bit_flip_refused_with_its_name(tmp_path):
    model, opt = _trained()
    path = tmp_path / "ck.pt"
    save_checkpoint(model, opt, 1, path)
    reference = torch.load(path, weights_only=True)["model"]["0.weight"]
    data = bytearray(path.read_bytes())
    # Flip one bit inside the stored bytes of the first weight matrix (found by its content).
    at = bytes(data).find(reference.numpy().tobytes())
    assert at > 0
    data[at + 5] ^= 0x04
    path.write_bytes(bytes(data))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="ck.pt is corrupt: its bytes do not match the SHA-256"):
        load_checkpoint(path, model, opt)
    assert _same_state(before, model.state_dict())


@pytest.mark.parametrize("kind", [str, os.fspath, lambda path: path])
def test_a_refusal_names_the_whole_path_given(tmp_path, kind):
    # The user's path as given (folders included), not only the file's name.
    path = tmp_path / "run" / "ck.pt"
    path.parent.mkdir()
    path.write_bytes(b"not a checkpoint, and too short for a trailer")
    model, opt = _trained()
    with pytest.raises(ValueError) as raised:
        load_checkpoint(kind(path), model, opt)
    assert str(raised.value).startswith(f"{path} is not a tlm-train-state/2 file")


def _fresh(seed=9):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def test_restore_state_puts_back_what_capture_state_took():
    model, opt = _trained()
    state = capture_state(model, opt, step=3)
    other = _fresh()
    other_opt = AdamW(other.parameters(), lr=1e-2)
    assert restore_state(state, other, other_opt) == 3
    assert _same_state(model.state_dict(), other.state_dict())
    assert _same_state(opt.state_dict(), other_opt.state_dict())  # torch's own view of the optimizer


def test_restore_state_puts_back_the_global_rngs_so_the_next_draws_repeat():
    import random

    import numpy as np

    model, opt = _trained()
    state = capture_state(model, opt, step=3)

    def draws():
        return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]  # noqa: NPY002

    expected = draws()  # what follows the captured state
    torch.manual_seed(123), np.random.seed(123), random.seed(123)  # noqa: NPY002 - elsewhere now
    assert draws() != expected
    other = _fresh()
    restore_state(state, other, AdamW(other.parameters(), lr=1e-2))
    assert draws() == expected


def test_restore_state_refuses_an_optimizer_with_other_groups():
    model, opt = _trained()
    state = capture_state(model, opt, step=3)
    other = _fresh()
    groups = [
        {"params": [p for p in other.parameters() if p.ndim >= 2]},
        {"params": [p for p in other.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    with pytest.raises(ValueError, match=r"optimizer groups hold other parameters .*sizes \[4\] saved, \[2, 2\] now"):
        restore_state(state, other, AdamW(groups, lr=1e-2))


def test_foreign_file_refused(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    model, opt = _trained()
    with pytest.raises(ValueError, match="other.pt is not a tlm-train-state/2 file"):
        load_checkpoint(tmp_path / "other.pt", model, opt)


def test_mismatched_model_or_optimizer_leaves_both_untouched(tmp_path):
    model, opt = _trained()
    save_checkpoint(model, opt, 1, tmp_path / "ck.pt")
    other = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    other_opt = AdamW(other.parameters())
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="shapes differ"):
        load_checkpoint(tmp_path / "ck.pt", other, other_opt)
    assert _same_state(before, other.state_dict())
    same_model, _ = _trained(2)
    split_opt = AdamW([{"params": list(same_model.parameters())[:2]}, {"params": list(same_model.parameters())[2:]}])
    before = {k: v.clone() for k, v in same_model.state_dict().items()}
    with pytest.raises(ValueError, match="parameter groups"):
        load_checkpoint(tmp_path / "ck.pt", same_model, split_opt)
    assert _same_state(before, same_model.state_dict())


def test_compiled_model_saves_under_plain_keys(tmp_path):
    model, opt = _trained()

    class Wrapper(nn.Module):  # what torch.compile returns: the real module under _orig_mod
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    save_checkpoint(Wrapper(model), opt, 1, tmp_path / "ck.pt")
    assert set(read_checkpoint(tmp_path / "ck.pt")["model"]) == set(model.state_dict())


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m, o, p: save_checkpoint("model", o, 1, p), TypeError, "model must be"),
        (lambda m, o, p: save_checkpoint(m, "opt", 1, p), TypeError, "optimizer must be"),
        (lambda m, o, p: save_checkpoint(m, o, -1, p), ValueError, "iteration"),
        (lambda m, o, p: save_checkpoint(m, o, 1.0, p), TypeError, "iteration"),
        (lambda m, o, p: save_checkpoint(m, o, 1, 42), TypeError, "out must be"),
        (lambda m, o, p: save_checkpoint(m, o, 1, p.parent), IsADirectoryError, "folder"),
        (lambda m, o, p: save_checkpoint(m, o, 1, p.parent / "nope" / "ck.pt"), FileNotFoundError, "nope"),
        (lambda m, o, p: load_checkpoint(42, m, o), TypeError, "src must be"),
        (lambda m, o, p: load_checkpoint(p, m, None), TypeError, "optimizer must be"),
    ],
)
def test_bad_arguments(tmp_path, call, error, match):
    model, opt = _trained()
    with pytest.raises(error, match=match):
        call(model, opt, tmp_path / "ck.pt")


# ---------------------------------------------------------------------------------------------
# Step folders: model.safetensors (tlm-model's file) + train_state.pt


def _lm_state(seed=0):
    from tlm_model import ModelConfig, TransformerLM

    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(48, 8, 16, 1, 2, 24), fused=False)
    opt = AdamW(model.parameters(), lr=1e-2)
    model.loss(torch.randint(0, 48, (2, 8)), torch.randint(0, 48, (2, 8))).backward()
    opt.step()
    return model, opt


def _save(manager, step, seed=0):
    from tlm_train import capture_state

    model, opt = _lm_state(seed)
    return manager.save(model, capture_state(model, opt, step=step))


def test_a_step_folder_holds_the_model_file_and_the_training_state(tmp_path):
    from tlm_model import load_model_file as load_model
    from tlm_train import CheckpointManager

    manager = CheckpointManager(tmp_path / "checkpoints", keep=3)
    path = _save(manager, 7)
    assert sorted(os.listdir(path)) == ["model.safetensors", "train_state.pt"]
    model, _ = _lm_state(0)
    assert _same_state(load_model(path).state_dict(), model.state_dict())  # the file tlm generate reads
    loaded = manager.load(7)
    assert loaded.step == 7 and _same_state(loaded.state["model"], model.state_dict())
    assert loaded.config == model.config
    assert (
        oct(path.stat().st_mode & 0o777) == oct(0o777 & ~_umask())
        and (path / "train_state.pt").stat().st_mode & 0o777 == 0o666 & ~_umask()
    )


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("name", ["model.safetensors", "train_state.pt"])
def test_a_flipped_bit_anywhere_in_a_step_folder_is_refused(tmp_path, name):
    from tlm_train import CheckpointManager

    manager = CheckpointManager(tmp_path, keep=5)
    _save(manager, 1)
    path = manager.path(1) / name
    data = bytearray(path.read_bytes())
    for at in range(0, len(data), max(1, len(data) // 40)):  # 40 positions spread over the file
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        path.write_bytes(bytes(flipped))
        with pytest.raises((ValueError, RuntimeError, OSError)):
            manager.load(1)
    path.write_bytes(bytes(data))
    assert manager.load(1).step == 1


def test_a_model_file_from_another_step_is_refused(tmp_path):
    from tlm_train import CheckpointManager

    manager = CheckpointManager(tmp_path, keep=5)
    _save(manager, 1, seed=0)
    _save(manager, 2, seed=1)
    shutil.copy(manager.path(2) / "model.safetensors", manager.path(1) / "model.safetensors")
    with pytest.raises(ValueError, match="belongs to another model file"):
        manager.load(1)


def test_load_latest_passes_over_damaged_folders_and_says_so(tmp_path):
    from tlm_train import CheckpointManager

    manager = CheckpointManager(tmp_path, keep=5)
    for step in (1, 2, 3):
        _save(manager, step)
    (manager.path(3) / "train_state.pt").write_bytes(b"not a checkpoint")
    (manager.path(2) / "model.safetensors").write_bytes(b"\x00" * 64)
    told = []
    assert manager.load_latest(on_damaged=lambda step, err: told.append(step)).step == 1
    assert told == [3, 2]
    for step in (1,):
        (manager.path(step) / "model.safetensors").unlink()  # incomplete: not listed at all
    assert manager.steps() == [2, 3] and manager.load_latest() is None


def test_prune_keeps_the_newest_and_removes_leftovers_of_killed_saves(tmp_path):
    from tlm_train import CheckpointManager

    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        _save(manager, step)
    leftover = tmp_path / f".step_00000004.{2**22 + 7}-{'c' * 16}.tmp"  # a save whose process died
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    assert manager.prune() == [1] and manager.steps() == [2, 3]
    assert manager.remove_leftovers() == [leftover] and sorted(os.listdir(tmp_path)) == [
        "latest",
        "step_00000002",
        "step_00000003",
    ]
    single = CheckpointManager(tmp_path, keep=1)
    single.prune()
    assert single.steps() == [3]  # never the newest


@pytest.mark.slow  # a writer process (importing torch takes seconds on a busy machine)
def test_a_reader_never_misses_a_checkpoint_while_another_process_saves_and_prunes(tmp_path, python, monkeypatch):
    import subprocess
    import time

    from tlm_train import CheckpointManager

    code = """
    import os, sys
    from tlm_model import ModelConfig, TransformerLM
    from tlm_optim import AdamW
    from tlm_train import CheckpointManager, capture_state
    manager = CheckpointManager(sys.argv[1], keep=1)
    model = TransformerLM(ModelConfig(16, 4, 8, 1, 1, 8), fused=False)
    opt = AdamW(model.parameters())
    manager.save(model, capture_state(model, opt, step=0))
    print("ready", flush=True)
    step, parent = 0, os.getppid()
    while os.getppid() == parent:  # until killed, or orphaned
        step += 1
        manager.save(model, capture_state(model, opt, step=step))
        manager.prune()
    """
    child = python(code, str(tmp_path), wait=False, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        listing = os.scandir

        def stale(path):  # the reader is held up after reading the folder, until the writer replaced what it saw
            entries = list(listing(path))
            seen = [entry.path for entry in entries if entry.name.startswith("step_")]
            deadline = time.monotonic() + 5
            while any(os.path.lexists(folder) for folder in seen) and time.monotonic() < deadline:
                time.sleep(0.001)
            return iter(entries)

        from tlm_train import checkpoint as module

        read_state = module.load_train_state

        def slow(path):  # ... and again after choosing a folder, until the writer saved two newer steps
            step = int(path.parent.name.removeprefix("step_"))
            deadline = time.monotonic() + 5
            while reader._pointer() < step + 2 and time.monotonic() < deadline:
                time.sleep(0.001)
            return read_state(path)

        monkeypatch.setattr(os, "scandir", stale)
        monkeypatch.setattr(module, "load_train_state", slow)
        reader = CheckpointManager(tmp_path, keep=1)
        found = [reader.load_latest() for _ in range(5)]
        monkeypatch.undo()
    finally:
        child.kill()
        child.wait()
    assert [checkpoint is not None for checkpoint in found] == [True] * 5
    steps = [checkpoint.step for checkpoint in found]
    assert steps == sorted(steps) and steps[-1] > 0  # each read saw the writer's newest step, not step 0 left over


def test_a_step_folder_removed_by_hand_leaves_the_listing_to_the_folders_left(tmp_path):
    from tlm_train import CheckpointManager

    manager = CheckpointManager(tmp_path, keep=1)
    for step in (1, 2):
        _save(manager, step)
    assert (tmp_path / "latest").read_text() == "step_00000002\n"
    shutil.rmtree(manager.path(2))  # the step `latest` names
    assert manager.steps() == [1] and manager.load_latest().step == 1
    _save(manager, 3)
    _save(manager, 2)  # an older step saved after a newer one: the newest save is kept, and the newest step
    assert manager.prune() == [1] and manager.steps() == [2, 3]


def _save_sharded(manager, step, seed=0):
    from tlm_train import capture_state

    model, opt = _lm_state(seed)
    state = capture_state(model, opt, step=step)
    state["sharded"] = True  # as DDP/FSDP2 ranks save it; here DCP writes the one rank's part
    return model, opt, manager.save(model, state)


def test_a_sharded_step_folder_restores_model_and_optimizer_exactly_and_gives_the_model(tmp_path):
    from tlm_artifacts import load_step_model
    from tlm_artifacts.steps import read_model_state
    from tlm_train import CheckpointManager

    manager = CheckpointManager(tmp_path, keep=5)
    model, opt, path = _save_sharded(manager, 3)
    assert sorted(os.listdir(path)) == ["shards", "train_state.pt"] and manager.steps() == [3]
    other, other_opt = _lm_state(seed=5)
    assert restore_state(manager.load(3).state, other, other_opt) == 3
    assert _same_state(model.state_dict(), other.state_dict())
    assert _same_state(opt.state_dict(), other_opt.state_dict())  # torch's own view of the optimizer
    config, weights = read_model_state(path)  # what generate/eval/convert read: the model's tensors only
    assert config == model.config and _same_state(weights, model.state_dict())
    assert _same_state(load_step_model(path).state_dict(), model.state_dict())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("flip .metadata", "do not match the SHA-256"),
        ("flip __0_0.distcp", "do not match the SHA-256"),
        ("add __1_0.distcp", "holds files .*__1_0.distcp"),
        ("remove __0_0.distcp", "lacks the shard files .*__0_0.distcp"),
    ],
)
def test_a_sharded_step_folder_whose_files_changed_is_refused_before_dcp_reads_it(tmp_path, change, match):
    from tlm_artifacts.steps import read_model_state
    from tlm_train import CheckpointManager

    manager = CheckpointManager(tmp_path, keep=5)
    _, _, path = _save_sharded(manager, 1)
    action, name = change.split()
    shard = path / "shards" / name
    if action == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    elif action == "add":
        shard.write_bytes(b"")
    else:
        shard.unlink()
    for read in (lambda: manager.load(1), lambda: read_model_state(path)):
        with pytest.raises(ValueError, match=match):
            read()


@pytest.mark.parametrize(
    ("craft", "match"),
    [
        ("code", "not a readable DCP metadata file .*may not build builtins.exec"),
        ("bytes item", "lists non-tensor items \\['model.ln_final.weight'\\]"),  # DCP would torch.load it unsafely
    ],
)
def test_a_crafted_dcp_metadata_pickle_runs_nothing_even_when_its_digest_is_recorded(tmp_path, craft, match):
    import hashlib
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from tlm_artifacts.steps import read_model_state
    from tlm_artifacts.train_state import load_train_state
    from tlm_train import CheckpointManager
    from tlm_train.checkpoint import save_train_state

    manager = CheckpointManager(tmp_path, keep=5)
    _, _, path = _save_sharded(manager, 1)
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(ran)!r}, 'w').close()",))

    if craft == "code":
        crafted = pickle.dumps(Payload())
    else:
        metadata = pickle.loads((path / "shards" / ".metadata").read_bytes())
        metadata.state_dict_metadata["model.ln_final.weight"] = BytesStorageMetadata()
        crafted = pickle.dumps(metadata)
    (path / "shards" / ".metadata").write_bytes(crafted)
    state = load_train_state(path / "train_state.pt")  # the attacker records the crafted file's digest too
    state["shard_files"][".metadata"] = hashlib.sha256(crafted).hexdigest()
    save_train_state(path / "train_state.pt", state)
    checkpoint = manager.load(1)
    other, other_opt = _lm_state(seed=5)
    for read in (lambda: restore_state(checkpoint.state, other, other_opt), lambda: read_model_state(path)):
        with pytest.raises(ValueError, match=match):
            read()
    assert not ran.exists()


def test_remove_after_abandons_later_steps_complete_or_not(tmp_path):
    from tlm_train import CheckpointManager

    manager = CheckpointManager(tmp_path, keep=5)
    for step in (1, 2, 3):
        _save(manager, step)
    (manager.path(3) / "train_state.pt").unlink()
    assert manager.remove_after(1) == [2, 3] and manager.all_steps() == [1]


#: A process that saves step folders in a loop, each filled with its step number, printing each step saved:
#: argv is the checkpoint folder and the last step saved. Under torchrun's variables it is one rank of an
#: FSDP2 run (every rank saves its DCP shards), else one process; either way it cleans a killed save's
#: leftovers before each save and prunes after it, as the recipe does.
SAVER = """
import sys, torch
from tlm_model import ModelConfig, TransformerLM
from tlm_optim import AdamW
from tlm_train import CheckpointManager, capture_state, init_distributed, wrap_model
from tlm_train.distributed import barrier
info = init_distributed("cpu")
model = TransformerLM(ModelConfig(512, 8, 256, 2, 4, 512), fused=False)
if info.world_size > 1:
    wrap_model(model, "fsdp")
opt = AdamW(model.parameters())
manager = CheckpointManager(sys.argv[1], keep=2)
step = int(sys.argv[2])
if len(sys.argv) > 3 and sys.argv[3] == "stalled":  # rank 0's writer stops after DCP wrote every file, before
    import threading, tlm_train.checkpoint  # hashing and renaming them into place: a save surely in flight
    def stalled(folder):
        print("in flight", flush=True)
        threading.Event().wait()
    tlm_train.checkpoint._file_digests = stalled
    sys.argv[3] = "background"
if len(sys.argv) > 3 and sys.argv[3] in ("background", "process"):  # the recipe's saves: a writer thread
    from tlm_train.checkpoint import BackgroundSaver  # (sharded: DCP's thread, or "process": DCP's writer process)
    saver, first = BackgroundSaver("process" if sys.argv[3] == "process" else "thread"), step + 1
    while True:
        step += 1
        saver.wait_staged()  # as train_step does before the update: DCP's async staging has copied step - 1
        with torch.no_grad():  # the next step's weights, written over the live tensors while step - 1 is saved
            for p in model.parameters():
                p.fill_(step)
        saver.wait()
        if step == first + 1 and sys.argv[3] == "process":  # each rank names its writer process
            from torch.distributed.checkpoint import _async_process_executor
            print("writer", _async_process_executor._CHECKPOINT_PROCESS._save_process.pid, flush=True)
        if step > first and info.is_main:
            print(step - 1, flush=True)
        if info.is_main:
            manager.remove_leftovers()
            manager.prune()
        saver.submit(manager, model, capture_state(model, opt, step=step))
while True:
    step += 1
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(step)
    if info.is_main:
        manager.remove_leftovers()
    manager.save(model, capture_state(model, opt, step=step))
    barrier()
    if info.is_main:
        manager.prune()
        print(step, flush=True)
"""


def _kill(ranks):
    """SIGKILL every rank; what rank 0 printed after its last line read (the steps it finished since)."""
    import signal

    for rank in ranks:
        rank.send_signal(signal.SIGKILL)
    rest = ranks[0].communicate()[0]
    for rank in ranks[1:]:
        rank.communicate()
    return rest


def _latest_after_kill(folder, done):
    """The newest step that verifies (every shard file's SHA-256) is ``done`` or the one in flight after it, and
    it holds its own step's values in every weight (the ranks filled them with the step before saving)."""
    from tlm_artifacts.steps import read_model_state
    from tlm_train import CheckpointManager

    latest = CheckpointManager(folder).load_latest()
    assert latest is not None and latest.step in (done, done + 1)
    assert all(bool((t == latest.step).all()) for t in read_model_state(latest.path)[1].values())
    return latest


@pytest.mark.slow  # two ranks killed mid-save, twice
@pytest.mark.parametrize("mode", ["inline", "background"])  # background: dcp.async_save, nearly always in flight
def test_sigkill_of_both_ranks_during_sharded_saves_leaves_the_previous_complete_step(tmp_path, forked, mode):
    """FSDP2 on two gloo ranks saves DCP step folders in a loop; both ranks die by SIGKILL at a random
    moment (after the first save, so often inside one). What is left is the newest complete step or the one
    before it, verified as it is read, and the leftovers of the interrupted save are cleaned away. In the
    background mode the weights are overwritten with the next step's while DCP writes a step, so a folder
    holding anything but its own step's values would show a snapshot that was not one."""
    import random
    import signal
    import socket
    import time

    from tlm_train import CheckpointManager

    rng, done = random.Random(11), 0
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        ranks = [
            forked(SAVER, str(tmp_path), str(done), mode, wait=False, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in (0, 1)
        ]
        try:
            line = ranks[0].stdout.readline()
            assert line, ranks[0].communicate()[1][-3000:]
            done = int(line)
            time.sleep(rng.uniform(0.0, 0.3))
        finally:
            rest = _kill(ranks)
        done = _latest_after_kill(tmp_path, max([done, *map(int, rest.split())])).step
    if mode == "background":  # and once surely mid-save: every shard written, the folder not yet in place
        env["MASTER_PORT"] = str(int(port) + 1) if int(port) < 65535 else str(int(port) - 1)
        ranks = [forked(SAVER, str(tmp_path), str(done), "stalled", wait=False,
                        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]  # fmt: skip
        try:
            assert ranks[0].stdout.readline() == "in flight\n", ranks[0].communicate()[1][-3000:]
        finally:
            for rank in ranks:
                rank.send_signal(signal.SIGKILL)
                rank.communicate()
        left = [p for p in tmp_path.iterdir() if p.name.startswith(f".step_{done + 1:08d}.")]  # temporary folders
        assert any((p / "shards" / ".metadata").is_file() for p in left)
        assert CheckpointManager(tmp_path).load_latest().step == done
    CheckpointManager(tmp_path, keep=2).remove_leftovers()
    assert all(name.startswith("step_") or name == "latest" for name in os.listdir(tmp_path))


@pytest.mark.slow  # two ranks, each with DCP's writer process (an interpreter start), killed mid-save
def test_sigkill_of_both_ranks_while_dcp_writer_processes_save_leaves_the_previous_complete_step(tmp_path, forked):
    """The sharded background save with DCP's writer process (``AsyncCheckpointerType.PROCESS``, torchtitan's):
    both ranks die by SIGKILL at a random moment after their writers have saved twice. The step folder is put in
    place by the rank, never by its writer, so what is left is the newest complete step or the one before it,
    each holding its own step's values (the weights change while a save is in flight); the orphaned writers
    exit by themselves (their parent's pipe closed), and what they leave is a leftover that is cleaned away."""
    import random
    import socket
    import time
    from pathlib import Path

    from tlm_train import CheckpointManager

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    ranks = [forked(SAVER, str(tmp_path), "0", "process", wait=False,
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]  # fmt: skip
    try:
        writers = []
        for rank in ranks:
            line = rank.stdout.readline()
            assert line.startswith("writer "), rank.communicate()[1][-3000:]
            writers.append(int(line.split()[1]))
        done = int(ranks[0].stdout.readline())
        time.sleep(random.Random(5).uniform(0.0, 0.3))
    finally:
        rest = _kill(ranks)
    latest = _latest_after_kill(tmp_path, max([done, *map(int, rest.split())]))

    def running(pid: int) -> bool:  # a zombie (an orphan its new parent has not reaped) has ended
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    deadline = time.monotonic() + 120
    while any(map(running, writers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(running, writers)), "a writer process outlived its killed rank"
    CheckpointManager(tmp_path, keep=2).remove_leftovers()
    assert all(name.startswith("step_") or name == "latest" for name in os.listdir(tmp_path))
    assert CheckpointManager(tmp_path).load_latest().step == latest.step


@pytest.mark.slow  # real processes killed mid-save
@pytest.mark.parametrize("mode", ["inline", "background"])  # background: BackgroundSaver's writer thread
def test_sigkill_during_step_folder_saves_leaves_the_previous_complete_step(tmp_path, forked, mode):
    # In the background mode the weights are overwritten with the next step's while a save is written, so a
    # folder holding anything but its own step's values would also show a snapshot that was not one.
    import random
    import signal
    import time

    from tlm_train import CheckpointManager

    rng, done = random.Random(7), 0
    for _ in range(4):
        child = forked(SAVER, str(tmp_path), str(done), mode, wait=False)
        try:
            done = int(child.stdout.readline())
            time.sleep(rng.uniform(0.0, 0.5))
        finally:
            child.send_signal(signal.SIGKILL)
            rest = child.communicate()[0]
        done = max([done, *map(int, rest.split())])
        latest = CheckpointManager(tmp_path).load_latest()
        assert latest is not None and latest.step in (done, done + 1)
        assert all(bool((t == latest.step).all()) for t in latest.state["model"].values())
        done = latest.step
    manager = CheckpointManager(tmp_path, keep=2)
    manager.remove_leftovers()
    assert all(name.startswith("step_") or name == "latest" for name in os.listdir(tmp_path))


def test_a_staged_state_is_a_snapshot_that_keeps_tied_tensors_tied():
    from tlm_train.checkpoint import stage_state

    weight = torch.arange(6.0).reshape(2, 3)
    state = {"model": {"a": weight, "tied": weight}, "optimizer": {"state": [{"exp_avg": torch.ones(2)}]}, "step": 3}
    staged, event = stage_state(state)
    weight.add_(100)  # training goes on after the snapshot
    state["optimizer"]["state"][0]["exp_avg"].zero_()
    assert event is None  # nothing to wait for on a CPU
    assert torch.equal(staged["model"]["a"], torch.arange(6.0).reshape(2, 3))
    assert staged["model"]["a"] is staged["model"]["tied"]
    assert torch.equal(staged["optimizer"]["state"][0]["exp_avg"], torch.ones(2)) and staged["step"] == 3


def _same_state(a, b) -> bool:
    """Equal nested state: tensors by value (and dtype), dicts by keys, lists and tuples item by item."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_state, a, b))
    return a == b


def test_a_background_save_writes_the_same_folder_and_raises_its_error_at_the_next_wait(tmp_path):
    from tlm_train.checkpoint import BackgroundSaver

    model = TransformerLM(ModelConfig(64, 8, 16, 1, 2, 32), fused=False)
    opt = AdamW(model.parameters())
    saver = BackgroundSaver()
    state = capture_state(model, opt, step=1)
    folder = saver.submit(CheckpointManager(tmp_path / "a"), model, state)
    CheckpointManager(tmp_path / "b").save(model, state)
    saver.wait()
    other = tmp_path / "b" / folder.name
    # train_state.pt holds the same state (its zip carries torch.save's random serialization id, so its bytes are
    # not compared); model.safetensors's metadata order is the library's, so its tensors and config are compared.
    a, b = (torch.load(f / "train_state.pt", weights_only=True) for f in (folder, other))
    assert _same_state(a, b)
    got, want = load_model_file(folder), load_model_file(other)
    assert got.config == want.config
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values(), strict=True))
    (tmp_path / "c").write_text("a file where the checkpoints folder should be")
    saver.submit(CheckpointManager(tmp_path / "c"), model, capture_state(model, opt, step=2))
    with pytest.raises(FileExistsError):
        saver.wait()
    saver.wait()  # the error was raised once


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's thread, in one process on purpose
def test_a_background_sharded_save_equals_the_inline_one_and_a_failed_one_leaves_nothing(tmp_path, monkeypatch):
    """dcp.async_save in one process (the sharded layout without a group): the same tensors and training
    state as an inline sharded save; a write that fails (a full disk) is raised by the next wait() as one
    OSError naming the step, and leaves no step folder and no temporary folder behind."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    from tlm_artifacts.steps import read_sharded_tensors
    from tlm_train.checkpoint import BackgroundSaver

    model = TransformerLM(ModelConfig(64, 8, 16, 1, 2, 32), fused=False)
    opt = AdamW(model.parameters())
    model(torch.randint(0, 64, (2, 8))).square().mean().backward()
    opt.step()
    state = {**capture_state(model, opt, step=1), "sharded": True}
    want = {k: v.clone() for k, v in model.state_dict().items()}
    CheckpointManager(tmp_path / "b").save(model, state)
    saver = BackgroundSaver()
    folder = saver.submit(CheckpointManager(tmp_path / "a"), model, state)
    assert saver._staging is not None  # DCP stages on its own thread (issue 42): the step goes on meanwhile
    saver.wait_staged()  # what train_step calls before the update
    with torch.no_grad():  # training goes on: the save holds the snapshot
        for p in model.parameters():
            p.add_(1.0)
    saver.wait()
    a, b = (CheckpointManager(tmp_path / x).load(1) for x in "ab")  # every shard file's SHA-256 verified
    assert a.path == folder and _same_state(read_sharded_tensors(folder), want)
    drop = ("shard_files", "shards", "model_config")
    assert _same_state({k: v for k, v in a.state.items() if k not in drop},
                       {k: v for k, v in b.state.items() if k not in drop})  # fmt: skip

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    saver.submit(CheckpointManager(tmp_path / "a"), model, {**capture_state(model, opt, step=2), "sharded": True})
    with pytest.raises(OSError, match="checkpoint of step 2 was not written: rank 0 failed: .*No space") as caught:
        saver.wait()
    assert caught.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path / "a")) == ["latest", "step_00000001"]
    saver.wait()  # the error was raised once


def test_a_step_that_was_never_saved_is_reported_as_missing_by_its_step(tmp_path):
    # Not as a folder removed while it was read (the message for a prune that races a reader).
    manager = CheckpointManager(tmp_path, keep=5)
    _save(manager, 1)
    manager.path(2).write_text("a file where step 2's folder would be")
    for step in (2, 3):
        with pytest.raises(FileNotFoundError, match=rf"^no checkpoint folder for step {step}: .*step_0000000{step}$"):
            manager.load(step)
    assert manager.load(1).step == 1


class _OnAnAccelerator(torch.Tensor):
    """A CPU tensor that says it is on another device: what stage_state copies into (pinned) host buffers."""

    device = property(lambda self: torch.device("xpu", 0))  # not "cuda": no CUDA event is recorded for it


def test_staged_accelerator_tensors_reuse_the_buffers_whose_shape_and_dtype_agree():
    from tlm_train.checkpoint import stage_state

    def state(w, b):
        return {"w": w.as_subclass(_OnAnAccelerator), "b": b.as_subclass(_OnAnAccelerator)}

    buffers: list[torch.Tensor] = []
    staged, event = stage_state(state(torch.arange(6.0).reshape(2, 3), torch.ones(3)), buffers)
    assert event is None and [id(t) for t in buffers] == [id(staged["w"]), id(staged["b"])]
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in buffers)
    kept = list(buffers)
    staged, _ = stage_state(state(torch.full((2, 3), 7.0), torch.ones(3, dtype=torch.float64)), buffers)
    assert staged["w"] is kept[0] and torch.equal(staged["w"], torch.full((2, 3), 7.0))  # the same shape and dtype
    assert staged["b"] is not kept[1] and torch.equal(staged["b"], torch.ones(3, dtype=torch.float64))  # a dtype
    assert [id(t) for t in buffers] == [id(staged["w"]), id(staged["b"])]
    staged, _ = stage_state(state(torch.zeros(3, 2), torch.ones(3, dtype=torch.float64)), buffers)
    assert staged["w"] is not kept[0] and staged["w"].shape == (3, 2) and staged["b"] is buffers[1]  # a shape


def test_the_writer_process_is_chosen_only_where_spawn_can_import_the_main_module(tmp_path, monkeypatch):
    """DCP's writer process starts with ``spawn``, which imports ``__main__`` again: "auto" takes it for ``-c``, a
    package's ``__main__`` (``torchrun -m tlm``) and a script with an ``if __name__ == "__main__":`` block, and
    the thread for a script that would train again in the writer; only for an accelerator's state (on CPU ranks
    the thread stalls less, docs/benchmarks.md); one process never gets a writer process."""
    import sys
    import types

    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import tlm_train.checkpoint as checkpoint

    def main(source: str | None = None, spec: str | None = None) -> types.ModuleType:
        module = types.ModuleType("__main__")
        if source is not None:
            path = tmp_path / f"script{len(list(tmp_path.iterdir()))}.py"
            path.write_text(source)
            module.__file__ = str(path)
        module.__spec__ = None if spec is None else types.SimpleNamespace(name=spec, origin=None)
        return module

    guarded = "import sys\nfrom tlm_train import train\n\nif __name__ == '__main__':\n    train(...)\n"
    reversed_guard = "if '__main__' == __name__:\n    pass\n"
    unguarded = "from tlm_train import train\ntrain(...)\n"
    nested = "def f():\n    if __name__ == '__main__':\n        pass\ntrain(...)\n"
    with pytest.raises(ValueError, match="writer must be 'auto', 'process' or 'thread', got 'fork'"):
        checkpoint.process_writer("fork")
    with pytest.raises(ValueError, match="writer must be"):
        checkpoint.BackgroundSaver("fork")
    assert checkpoint.process_writer("process") is None  # one process: DCP's thread
    monkeypatch.setattr(checkpoint, "_distributed", lambda: True)
    cases = {main(): True, main(spec="tlm.__main__"): True, main(guarded): True, main(reversed_guard): True,
             main(unguarded): False, main(nested): False, main("this is not python ("): False}  # fmt: skip
    for module, safe in cases.items():
        monkeypatch.setitem(sys.modules, "__main__", module)
        assert checkpoint._main_is_spawn_safe() is safe, getattr(module, "__file__", module.__spec__)
        assert checkpoint.process_writer("auto") is (AsyncCheckpointerType.PROCESS if safe else None)
        assert checkpoint.process_writer("auto", accelerator=False) is None
        assert checkpoint.process_writer("process", accelerator=False) is AsyncCheckpointerType.PROCESS
        assert checkpoint.process_writer("thread") is None
    # A torch whose AsyncCheckpointerType has no PROCESS (feature detection): DCP's thread, whatever is asked.
    import enum

    from torch.distributed.checkpoint import state_dict_saver

    monkeypatch.setattr(state_dict_saver, "AsyncCheckpointerType", enum.Enum("Old", {"THREAD": "thread"}))
    assert checkpoint.process_writer("process") is None
