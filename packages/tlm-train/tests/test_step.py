"""One optimizer step against independent references: a hand-written torch loop (F.cross_entropy on full
logits, torch's clip_grad_norm_ and AdamW); the non-finite stop; float16 loss scaling; parameter groups."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tlm_model import ModelConfig, TransformerLM
from tlm_optim import AdamW, CosineSchedule
from tlm_train import LanguageModelLoss, NonFiniteGuard, NonFiniteLossError, parameter_groups, train_step

VOCAB, SEQ = 40, 12


def _model(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(VOCAB, SEQ, 32, 2, 2, 64), fused=False)


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
        assert isinstance(stats.loss, torch.Tensor) and stats.loss.ndim == 0  # read only when the loop logs
        assert float(stats.loss) == pytest.approx(loss.item(), rel=1e-6)
        assert float(stats.grad_norm) == pytest.approx(norm.item(), rel=1e-5)
        assert stats.lr == 1e-2
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        record_error("train_step x3 vs hand-written torch loop", got, want)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)


def test_a_steps_stats_are_a_read_only_record() -> None:
    model = _model()
    stats = train_step(LanguageModelLoss(model), AdamW(model.parameters(), lr=1e-3), [_batch(2, 0)], max_grad_norm=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.lr = 0.5  # type: ignore[misc]
    assert stats.lr == 1e-3


def test_accumulation_turns_fsdp_gradient_sync_off_for_all_but_the_last_micro_batch() -> None:
    # FSDP2's switch, recorded on a one-process stand-in: off for micro-batches 1 and 2, on again
    # after each, and left on for the last micro-batch, whose backward does the reduce-scatter.
    class Recorded(LanguageModelLoss):
        def __init__(self, model):
            super().__init__(model)
            self.calls = []

        def set_requires_gradient_sync(self, flag):
            self.calls.append(flag)

        def forward(self, inputs, targets):
            self.calls.append("forward")
            return super().forward(inputs, targets)

    model = _model()
    module = Recorded(model)
    train_step(module, AdamW(model.parameters(), lr=1e-3), [_batch(2, i) for i in range(3)], max_grad_norm=1.0)
    assert module.calls == [False, "forward", True, False, "forward", True, "forward"]


def test_train_step_runs_on_a_torch_built_without_distributed(monkeypatch) -> None:
    # There torch.distributed.is_available() is False and is_initialized does not exist.
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    monkeypatch.delattr(torch.distributed, "is_initialized")
    model, reference = _model(), _model()
    stats = train_step(LanguageModelLoss(model), AdamW(model.parameters(), lr=1e-3), [_batch(2, 0)], max_grad_norm=1.0)
    inputs, targets = _batch(2, 0)
    expected = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
    assert float(stats.loss) == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("where", ["weights", "lr"])
def test_non_finite_loss_stops_before_the_update(where) -> None:
    model = _model()
    optimizer = AdamW(model.parameters(), lr=1e-2)
    if where == "weights":
        with torch.no_grad():
            model.layers[0].ln1.weight[0] = float("nan")
    else:  # a finite loss whose gradient overflows
        with torch.no_grad():
            model.lm_head.weight.mul_(1e37)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteLossError, match="stopped before the update"):
        train_step(LanguageModelLoss(model), optimizer, [_batch(4, 0)])
    for key, value in model.state_dict().items():
        assert torch.equal(value.nan_to_num(), before[key].nan_to_num()), key
    assert not optimizer.state  # no step was taken
    assert all(p.grad is None for p in model.parameters())


def test_train_step_refuses_an_empty_batch_list() -> None:
    model = _model()
    with pytest.raises(ValueError, match="micro_batches must hold at least one"):
        train_step(LanguageModelLoss(model), AdamW(model.parameters()), [])


def test_float16_with_a_grad_scaler_matches_float32_steps_and_skips_overflow() -> None:
    # float16 autocast underflows small gradients without loss scaling; torch.amp.GradScaler scales the loss
    # up, unscales the gradients before clipping and skips a step whose gradients overflowed.
    model, reference = _model(), _model()
    opt, ref_opt = AdamW(model.parameters(), lr=1e-3), AdamW(reference.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for step in range(3):
        batch = [_batch(4, step)]
        stats = train_step(LanguageModelLoss(model), opt, batch, max_grad_norm=1.0, autocast_dtype=torch.float16,
                           scaler=scaler)  # fmt: skip
        train_step(LanguageModelLoss(reference), ref_opt, batch, max_grad_norm=1.0)
        assert torch.isfinite(stats.loss)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=5e-3, rtol=0)  # float16 matmuls: ~1e-3 relative
    overflow = torch.amp.GradScaler("cpu", init_scale=2.0**120)  # so large that float16 gradients overflow
    before = [p.clone() for p in model.parameters()]
    train_step(LanguageModelLoss(model), opt, [_batch(4, 9)], autocast_dtype=torch.float16, scaler=overflow)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # skipped
    assert overflow.get_scale() < 2.0**120  # and the scale came down


def test_parameter_groups_exempt_norm_gains_from_weight_decay() -> None:
    model = _model()
    groups = parameter_groups(model, 0.1)
    decayed, exempt = groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and exempt["weight_decay"] == 0.0
    assert {names[id(p)].rsplit(".", 2)[-2] for p in exempt["params"]} == {"ln1", "ln2", "ln_final"}
    assert all(p.ndim == 2 for p in decayed["params"])
    assert len(decayed["params"]) + len(exempt["params"]) == len(list(model.parameters()))
    (everything,) = parameter_groups(model, 0.1, decay_norms=True)
    assert len(everything["params"]) == len(list(model.parameters()))
    # A gain under decay shrinks; exempt, an AdamW step with a zero gradient leaves it where it is.
    optimizer = AdamW(groups, lr=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    gain, head = model.ln_final.weight.detach().clone(), model.lm_head.weight.detach().clone()
    optimizer.step()
    assert torch.equal(model.ln_final.weight, gain)
    torch.testing.assert_close(model.lm_head.weight, head * (1 - 0.5 * 0.1))  # decoupled decay: θ(1 - αλ)


@pytest.mark.parametrize("fused", [None, False])  # torch's fused AdamW kernel, and the foreach path
def test_a_step_after_the_first_reads_nothing_back_to_the_host(fused, host_reads) -> None:
    # On an accelerator a read (.item(), bool(t)) waits for the device; with a guard the step returns its stats as
    # tensors and skips a non-finite update on the device. The first step builds the optimizer state, so it is not
    # counted; a non-finite step reads nothing either.
    model = _model()
    optimizer, loss_module = AdamW(model.parameters(), lr=1e-3, fused=fused), LanguageModelLoss(model)
    guard = NonFiniteGuard("cpu")
    train_step(loss_module, optimizer, [_batch(2, 0)], max_grad_norm=1.0, guard=guard)
    with host_reads() as reads:
        train_step(loss_module, optimizer, [_batch(2, 1), _batch(2, 2)], max_grad_norm=1.0, guard=guard)
        train_step(_Poisoned(model, {1}), optimizer, [_batch(2, 3)], max_grad_norm=1.0, guard=guard)
    assert reads == []
    assert guard.first() == 3


@pytest.mark.parametrize("fused", [None, False])
def test_a_step_after_the_first_copies_nothing_either_way(fused, host_transfers) -> None:
    # Issue 42: host-to-device copies count too. The fused path used to build its step scalar from the host each
    # step (torch.tensor(float(step), device=...): aten::lift_fresh, on CUDA a blocking copy); it is now a
    # counter on the device. Gradient accumulation, clipping, the schedule and a skipped non-finite step included.
    model = _model()
    optimizer, loss_module = AdamW(model.parameters(), lr=1e-3, fused=fused), LanguageModelLoss(model)
    scheduler = CosineSchedule(optimizer, max_learning_rate=1e-3, min_learning_rate=1e-4, warmup_iters=1,
                               cosine_cycle_iters=8)  # fmt: skip
    guard = NonFiniteGuard("cpu")
    kwargs = {"max_grad_norm": 1.0, "guard": guard, "scheduler": scheduler}
    train_step(loss_module, optimizer, [_batch(2, 0)], **kwargs)
    with host_transfers() as copies:
        train_step(loss_module, optimizer, [_batch(2, 1), _batch(2, 2)], **kwargs)
        train_step(loss_module, optimizer, [_batch(2, 3)], **kwargs)
        train_step(_Poisoned(model, {1}), optimizer, [_batch(2, 4)], **kwargs)
    assert copies == []
    assert guard.first() == 4


def test_a_logging_step_reads_the_guard_loss_and_norm_in_one_transfer(host_transfers) -> None:
    model = _model()
    optimizer, loss_module = AdamW(model.parameters(), lr=1e-3), LanguageModelLoss(model)
    guard = NonFiniteGuard("cpu")
    stats = train_step(loss_module, optimizer, [_batch(2, 0)], max_grad_norm=1.0, guard=guard)
    with host_transfers() as copies:
        loss, norm = guard.check(optimizer, also=(stats.loss, stats.grad_norm))
    assert copies == ["D2H Tensor.tolist"]
    assert (loss, norm) == (stats.loss.item(), stats.grad_norm.item())


class _Poisoned(LanguageModelLoss):
    """The loss times NaN on the chosen calls (counted from 1): a non-finite loss and NaN gradients."""

    def __init__(self, model, calls):
        super().__init__(model)
        self.calls, self.count = calls, 0

    def forward(self, inputs, targets):
        self.count += 1
        loss = super().forward(inputs, targets)
        return loss * float("nan") if self.count in self.calls else loss


def _assert_identical(got, want, where=""):
    """Bit-exact equality of nested state dicts (tensors by torch.equal, NaN-free)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_identical(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_identical(a, b, f"{where}/{i}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


@pytest.mark.parametrize("fused", [None, False])  # the fused kernel's found_inf, and the foreach path's restore
def test_a_non_finite_step_is_skipped_on_the_device_and_stops_where_the_loop_reads(fused) -> None:
    # The device path: steps 3 (NaN) and 4 run without raising; the guard, read afterwards, names step 3 and
    # leaves the weights, the optimizer state (moments, counters, lr) and the schedule bit-for-bit as after step 2.
    model = _model()
    optimizer = AdamW(parameter_groups(model, 0.1), lr=1e-2, weight_decay=0.1, fused=fused)
    scheduler = CosineSchedule(optimizer, 1e-2, 1e-3, warmup_iters=2, cosine_cycle_iters=10)
    loss_module, guard = _Poisoned(model, {3}), NonFiniteGuard("cpu")
    for step in (1, 2):
        train_step(loss_module, optimizer, [_batch(2, step)], scheduler=scheduler, max_grad_norm=1.0, guard=guard)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(optimizer.state_dict())
    schedule = copy.deepcopy(scheduler.state_dict())
    for step in (3, 4):  # no raise at the step
        train_step(loss_module, optimizer, [_batch(2, step)], scheduler=scheduler, max_grad_norm=1.0, guard=guard)
    with pytest.raises(NonFiniteLossError, match=r"training loss is nan, gradient norm nan: stopped before the update"):
        guard.check(optimizer, scheduler)
    assert guard.first() == 3
    _assert_identical(model.state_dict(), weights)
    _assert_identical(optimizer.state_dict(), state)
    _assert_identical(scheduler.state_dict(), schedule)


def test_an_optimizer_without_found_inf_is_stopped_before_its_step() -> None:
    # torch.optim.SGD cannot skip on the device: the step reads the flag and raises, weights and state untouched.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(LanguageModelLoss(model), optimizer, [_batch(2, 0)], guard=NonFiniteGuard("cpu"))
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    with pytest.raises(NonFiniteLossError, match="training loss is nan"):
        train_step(_Poisoned(model, {1}), optimizer, [_batch(2, 1)], guard=NonFiniteGuard("cpu"))
    _assert_identical(model.state_dict(), weights)
    _assert_identical(optimizer.state_dict(), state)
