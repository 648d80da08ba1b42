"""Property-based tests (hypothesis) of the schedule, clipping and AdamW."""

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from tlm_optim import AdamW, clip_grad_norm_, cosine_lr

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


@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=20), st.floats(1e-3, 1e3))
def test_clipping_caps_the_norm_and_keeps_the_direction(values, max_norm):
    p = torch.zeros(len(values), dtype=torch.float64, requires_grad=True)
    p.grad = torch.tensor(values, dtype=torch.float64)
    before = p.grad.clone()
    norm = clip_grad_norm_([p], max_norm).item()
    assert math.isclose(norm, before.norm().item(), rel_tol=1e-12, abs_tol=1e-300)
    assert p.grad.norm().item() <= max_norm * (1 + 1e-12)
    if norm <= max_norm:
        assert torch.equal(p.grad, before)
    else:
        torch.testing.assert_close(p.grad * (norm + 1e-6) / max_norm, before)


@given(st.floats(1e-5, 1e-1), st.floats(0.0, 0.5), st.floats(0.5, 0.99), st.floats(0.9, 0.9999), st.integers(1, 8))
def test_first_step_moves_each_coordinate_by_lr_times_sign(lr, decay, beta1, beta2, seed):
    # At t = 1: m = (1-β₁)g, v = (1-β₂)g², α₁ = α√(1-β₂)/(1-β₁), so the Adam step is α·g/(|g| + ε/√(1-β₂)).
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(6, generator=gen, dtype=torch.float64)
    grad = torch.randn(6, generator=gen, dtype=torch.float64)
    p = theta.clone().requires_grad_()
    p.grad = grad.clone()
    AdamW([p], lr=lr, betas=(beta1, beta2), eps=1e-12, weight_decay=decay).step()
    expected = (theta - lr * grad / (grad.abs() + 1e-12 / math.sqrt(1 - beta2))) * (1 - lr * decay)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-10, atol=1e-14)
