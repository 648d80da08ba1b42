"""cosine_lr against the course's closed form at its boundaries; CosineSchedule on torch optimizers."""

import io
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tlm_optim import AdamW, CosineSchedule, cosine_lr

A_MAX, A_MIN, T_W, T_C = 1.0, 0.1, 7, 21


def _closed_form(t):
    # (1 + cos x) / 2 = cos²(x / 2): the same curve written another way.
    if t < T_W:
        return A_MAX * t / T_W
    if t > T_C:
        return A_MIN
    return A_MIN + (A_MAX - A_MIN) * math.cos(math.pi / 2 * (t - T_W) / (T_C - T_W)) ** 2


@pytest.mark.parametrize("t", [0, 1, T_W - 1, T_W, T_W + 1, (T_W + T_C) // 2, T_C - 1, T_C, T_C + 1, 10 * T_C])
def test_boundaries_match_closed_form(t):
    assert cosine_lr(t, A_MAX, A_MIN, T_W, T_C) == pytest.approx(_closed_form(t), rel=1e-12, abs=1e-15)


def test_named_points():
    assert cosine_lr(0, A_MAX, A_MIN, T_W, T_C) == 0.0
    assert cosine_lr(T_W, A_MAX, A_MIN, T_W, T_C) == A_MAX
    assert cosine_lr(T_C, A_MAX, A_MIN, T_W, T_C) == pytest.approx(A_MIN, abs=1e-15)
    assert cosine_lr(T_C + 1, A_MAX, A_MIN, T_W, T_C) == A_MIN
    # Midway through the cosine the rate is midway between the two.
    assert cosine_lr(14, A_MAX, A_MIN, 7, 21) == pytest.approx((A_MAX + A_MIN) / 2, abs=1e-15)


def test_no_warmup_and_empty_cosine():
    assert cosine_lr(0, A_MAX, A_MIN, 0, 10) == A_MAX
    assert cosine_lr(5, A_MAX, A_MIN, 5, 5) == A_MAX
    assert cosine_lr(6, A_MAX, A_MIN, 5, 5) == A_MIN


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((-1, 1.0, 0.1, 7, 21), ValueError, "t must"),
        ((1.5, 1.0, 0.1, 7, 21), TypeError, "t must"),
        ((1, -1.0, 0.1, 7, 21), ValueError, "max_learning_rate"),
        ((1, 1.0, "0.1", 7, 21), TypeError, "min_learning_rate"),
        ((1, 1.0, 0.1, -7, 21), ValueError, "warmup_iters"),
        ((1, 1.0, 0.1, 7, 3), ValueError, "cosine_cycle_iters"),
        ((1, 1.0, 0.1, True, 21), TypeError, "warmup_iters"),
    ],
)
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        cosine_lr(*args)


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.5), lambda p: AdamW(p, lr=0.5)])
def test_scheduler_sets_every_group(make):
    opt = make([{"params": [torch.zeros(1, requires_grad=True)]}, {"params": [torch.zeros(1, requires_grad=True)]}])
    sched = CosineSchedule(opt, A_MAX, A_MIN, T_W, T_C)
    for t in range(T_C + 5):
        assert [g["lr"] for g in opt.param_groups] == [pytest.approx(_closed_form(t), abs=1e-15)] * 2
        assert sched.get_last_lr() == [g["lr"] for g in opt.param_groups]
        opt.step()
        sched.step()


def test_scheduler_state_survives_weights_only_load():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    sched = CosineSchedule(opt, A_MAX, A_MIN, T_W, T_C)
    for _ in range(9):
        opt.step()
        sched.step()
    buffer = io.BytesIO()
    torch.save(sched.state_dict(), buffer)
    buffer.seek(0)
    opt2 = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    sched2 = CosineSchedule(opt2, A_MAX, A_MIN, T_W, T_C)
    sched2.load_state_dict(torch.load(buffer, weights_only=True))
    for _ in range(3):
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(_closed_form(12))


def test_scheduler_refuses_non_optimizer():
    with pytest.raises(TypeError, match="optimizer"):
        CosineSchedule(object(), A_MAX, A_MIN, T_W, T_C)  # type: ignore[arg-type]


# Property-based (hypothesis; the profile in the root conftest.py decides how many examples run).
rates = st.floats(0.0, 10.0, allow_nan=False)


@given(st.integers(0, 500), rates, rates, st.integers(0, 100), st.integers(0, 200))
def test_schedule_is_bounded_and_piecewise_monotone(t, a, b, warmup, extra):
    high, low = max(a, b), min(a, b)
    cycle = warmup + extra
    lr = cosine_lr(t, high, low, warmup, cycle)
    assert 0.0 <= lr <= high * (1 + 1e-12)
    nxt = cosine_lr(t + 1, high, low, warmup, cycle)
    if t + 1 <= warmup:
        assert nxt >= lr
    else:
        assert nxt <= lr * (1 + 1e-12) + 1e-15
    if t >= warmup:
        assert lr >= low * (1 - 1e-12)
