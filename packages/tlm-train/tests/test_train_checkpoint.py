"""save_checkpoint / load_checkpoint: round trips, all-or-nothing writes, refusal of bad files."""

import io
import os
import tempfile

import pytest
import torch
from torch import nn

from tlm_optim import AdamW, CosineSchedule
from tlm_train import load_checkpoint, read_checkpoint, rng_state, save_checkpoint


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
    assert payload["iteration"] == 3 and set(payload["model"]) == set(model.state_dict())


def test_no_temporary_files_left_and_old_file_replaced(tmp_path):
    model, opt = _trained()
    for i in range(3):
        save_checkpoint(model, opt, i, tmp_path / "ck.pt")
    assert os.listdir(tmp_path) == ["ck.pt"]
    assert read_checkpoint(tmp_path / "ck.pt")["iteration"] == 2


def test_failed_save_keeps_the_old_checkpoint(tmp_path):
    model, opt = _trained()
    save_checkpoint(model, opt, 1, tmp_path / "ck.pt")
    with pytest.raises(TypeError, match=r"extra\]\['bad'\]|extra'\]\['bad'\]"):
        save_checkpoint(model, opt, 2, tmp_path / "ck.pt", bad=object())
    assert read_checkpoint(tmp_path / "ck.pt")["iteration"] == 1
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
    assert read_checkpoint(tmp_path / "ck.pt")["iteration"] == 1


def test_symlink_at_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    trap = tmp_path / ".ck.pt.trap.tmp"
    trap.symlink_to(victim)
    names = iter(["trap", "fresh"])
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    model, opt = _trained()
    save_checkpoint(model, opt, 1, tmp_path / "ck.pt")
    assert victim.read_text() == "keep me" and trap.is_symlink()
    assert read_checkpoint(tmp_path / "ck.pt")["iteration"] == 1


def test_truncated_file_refused_with_its_name(tmp_path):
    model, opt = _trained()
    path = tmp_path / "ck.pt"
    save_checkpoint(model, opt, 1, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="ck.pt is not a readable checkpoint"):
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
    with pytest.raises(ValueError, match="ck.pt is corrupt"):
        load_checkpoint(path, model, opt)
    assert _same_state(before, model.state_dict())


def test_foreign_file_refused(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    model, opt = _trained()
    with pytest.raises(ValueError, match="other.pt is not a tlm-train-checkpoint/1 file"):
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
        (lambda m, o, p: save_checkpoint(m, o, 1, p.parent), ValueError, "directory"),
        (lambda m, o, p: save_checkpoint(m, o, 1, p.parent / "nope" / "ck.pt"), FileNotFoundError, "nope"),
        (lambda m, o, p: load_checkpoint(42, m, o), TypeError, "src must be"),
        (lambda m, o, p: load_checkpoint(p, m, None), TypeError, "optimizer must be"),
    ],
)
def test_bad_arguments(tmp_path, call, error, match):
    model, opt = _trained()
    with pytest.raises(error, match=match):
        call(model, opt, tmp_path / "ck.pt")
