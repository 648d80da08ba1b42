"""The loop's public parts against independent references: a hand-written torch loop
(F.cross_entropy on full logits, torch's clip_grad_norm_ and AdamW), F.cross_entropy for the
evaluation, and the failure modes (non-finite loss, failed checkpoint writes, corrupt files)."""

import errno
import os

import pytest
import torch
import torch.nn.functional as F

from tlm_model import TransformerLM
from tlm_optim import AdamW
from tlm_train import (
    CheckpointManager,
    LanguageModelLoss,
    NonFiniteLossError,
    capture_state,
    evaluate_loss,
    restore_state,
    train_step,
)

VOCAB, SEQ = 40, 12


def _model(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(
        ModelConfig(vocab_size=VOCAB, context_length=SEQ, d_model=32, num_layers=2, num_heads=2, d_ff=64), fused=False
    )


def _batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def test_train_step_with_accumulation_equals_a_hand_written_torch_loop(record_error) -> None:
    model, reference = _model(), _model()
    # Independent reference: full logits + F.cross_entropy, torch's clipping and torch's AdamW.
    # weight_decay=0 so that the course's and torch's decay orders agree, and eps=1e-30 because
    # they place eps differently (√v + ε vs √v/√(1-β₂ᵗ) + ε), which for the tiny gradients of
    # this model changes updates by up to ~ε/√v ≈ 1e-3 relative; with ε → 0 both are α_t·m/√v.
    optimizer = AdamW(model.parameters(), lr=1e-2, eps=1e-30, weight_decay=0.0)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-30, weight_decay=0.0)
    loss_module = LanguageModelLoss(model)
    for step in range(3):
        inputs, targets = _batch(8, step)
        micro = [(inputs[:4], targets[:4]), (inputs[4:], targets[4:])]
        stats = train_step(loss_module, optimizer, micro, max_grad_norm=0.5)
        torch_optimizer.zero_grad()
        loss = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        torch_optimizer.step()
        assert stats.loss == pytest.approx(loss.item(), rel=1e-6)
        assert stats.grad_norm == pytest.approx(norm.item(), rel=1e-5)
        assert stats.lr == 1e-2
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        record_error("train_step x3 vs hand-written torch loop", got, want)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)


def test_non_finite_loss_stops_before_the_update() -> None:
    model = _model()
    optimizer = AdamW(model.parameters(), lr=1e-2)
    with torch.no_grad():
        model.layers[0].ln1.weight[0] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteLossError, match="stopping before the update"):
        train_step(LanguageModelLoss(model), optimizer, [_batch(4, 0)])
    for key, value in model.state_dict().items():
        assert torch.equal(value.nan_to_num(), before[key].nan_to_num()), key
    assert not optimizer.state  # no step was taken
    assert all(p.grad is None for p in model.parameters())


def test_train_step_refuses_an_empty_batch_list() -> None:
    model = _model()
    with pytest.raises(ValueError, match="micro_batches must hold at least one"):
        train_step(LanguageModelLoss(model), AdamW(model.parameters()), [])


def test_evaluate_loss_is_the_token_weighted_mean_cross_entropy() -> None:
    model = _model()
    batches = [_batch(3, 1), _batch(1, 2)]  # unequal sizes: a plain mean of batch means would differ
    got = evaluate_loss(LanguageModelLoss(model).train(), batches)
    inputs = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    with torch.no_grad():
        want = F.cross_entropy(model(inputs).double().flatten(0, 1), targets.flatten()).item()
    assert got == pytest.approx(want, rel=1e-6)
    assert model.training  # the mode is restored


def test_capture_and_restore_continue_bit_identically(tmp_path) -> None:
    def steps(model: TransformerLM, optimizer: AdamW, seeds: range) -> None:
        for seed in seeds:
            train_step(LanguageModelLoss(model), optimizer, [_batch(4, seed)], max_grad_norm=1.0)

    model = _model()
    optimizer = AdamW(model.parameters(), lr=1e-2)
    steps(model, optimizer, range(2))
    manager = CheckpointManager(tmp_path)
    manager.save(capture_state(model, optimizer, step=2))
    steps(model, optimizer, range(2, 4))

    resumed = _model(seed=99)  # different initial weights: all must come from the checkpoint
    resumed_optimizer = AdamW(resumed.parameters(), lr=1e-2)
    assert restore_state(manager.load_latest(), resumed, resumed_optimizer) == 2
    steps(resumed, resumed_optimizer, range(2, 4))
    for (key, got), want in zip(resumed.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(got, want), key


def test_checkpoint_manager_keeps_the_newest(tmp_path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        manager.save({"step": step, "x": torch.tensor([step])})
    assert manager.steps() == [2, 3]
    assert manager.load_latest()["step"] == 3


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch) -> None:
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save({"step": 1, "x": torch.ones(3)})
    # A writer that fails half-way (torch.save cannot pickle a lambda) ...
    with pytest.raises(Exception, match="lambda|pickle|Can't"):
        manager.save({"step": 2, "x": torch.ones(3), "bad": lambda: None})

    # ... and a full disk at fsync.
    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        manager.save({"step": 3, "x": torch.ones(3)})
    monkeypatch.undo()
    assert manager.steps() == [1]
    assert torch.equal(manager.load_latest()["x"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001.pt"]  # no temporary files left


def test_load_latest_passes_over_a_corrupt_newest_file(tmp_path) -> None:
    manager = CheckpointManager(tmp_path, keep=5)
    manager.save({"step": 1, "x": torch.ones(2)})
    manager.path(2).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="step_00000002.pt is not a readable"):
        manager.load(2)
    assert manager.load_latest()["step"] == 1


def test_checkpoint_manager_refuses_bad_keep(tmp_path) -> None:
    with pytest.raises(ValueError, match="keep must be an int >= 1, got 0"):
        CheckpointManager(tmp_path, keep=0)
