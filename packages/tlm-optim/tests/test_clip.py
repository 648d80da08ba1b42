"""clip_grad_norm_ against torch.nn.utils.clip_grad_norm_."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tlm_optim import clip_grad_norm_


def _params(scale, dtype=torch.float32, with_none=True):
    gen = torch.Generator().manual_seed(4)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    ps = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(dtype)
    if with_none:
        ps.append(torch.randn(3, requires_grad=True))  # no gradient: skipped
    return ps


@pytest.mark.parametrize("scale", [1e-4, 0.1, 1.0, 1e3])
@pytest.mark.parametrize("max_norm", [1e-2, 1.0, 5.0])
def test_matches_torch(scale, max_norm, record_error):
    ours, theirs = _params(scale), _params(scale)
    norm = clip_grad_norm_(ours, max_norm)
    expected_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    torch.testing.assert_close(norm, expected_norm)
    for a, b in zip(ours, theirs, strict=True):
        if a.grad is None:
            assert b.grad is None
            continue
        record_error("clip_grad_norm_ vs torch.nn.utils.clip_grad_norm_", a.grad, b.grad)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_an_infinite_maximum_returns_the_norm_and_clips_nothing_as_torch_does():
    ours, theirs = _params(1e3), _params(1e3)
    before = [p.grad.clone() for p in ours if p.grad is not None]
    torch.testing.assert_close(
        clip_grad_norm_(ours, float("inf")), torch.nn.utils.clip_grad_norm_(theirs, float("inf"))
    )
    assert all(torch.equal(a, p.grad) for a, p in zip(before, [p for p in ours if p.grad is not None], strict=True))


def test_below_the_maximum_leaves_gradients_bit_identical():
    ps = _params(1e-3)
    before = [p.grad.clone() for p in ps if p.grad is not None]
    clip_grad_norm_(ps, 1.0)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, [p for p in ps if p.grad is not None], strict=True))


def test_norm_is_float64_of_all_gradients():
    ps = _params(3.0, with_none=False)
    expected = torch.cat([p.grad.double().flatten() for p in ps]).norm()
    torch.testing.assert_close(clip_grad_norm_(ps, 1e9).double(), expected, rtol=1e-6, atol=0)


def test_mixed_dtypes_and_single_tensor():
    a = _params(10.0, with_none=False)[0]
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b.grad = torch.randn(4, dtype=torch.float64) * 10
    joint = torch.cat([a.grad.double().flatten(), b.grad.flatten()]).norm()
    clip_grad_norm_([a, b], 1.0)
    after = torch.cat([a.grad.double().flatten(), b.grad.flatten()]).norm()
    assert after.item() == pytest.approx(joint.item() / (joint.item() + 1e-6), rel=1e-6)
    c = torch.ones(4, requires_grad=True)
    c.grad = torch.full((4,), 3.0)
    assert clip_grad_norm_(c, 1.0).item() == pytest.approx(6.0)


def test_no_gradients_returns_zero():
    assert clip_grad_norm_([torch.zeros(2, requires_grad=True)], 1.0).item() == 0.0


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((3, 1.0), TypeError, "parameters"),
        (([1.0], 1.0), TypeError, r"parameters\[0\]"),
        (([], -1.0), ValueError, "max_l2_norm"),
        (([], "1"), TypeError, "max_l2_norm"),
        (([], float("nan")), ValueError, "max_l2_norm must be a finite number >= 0, got nan"),
        (([], -float("inf")), ValueError, "max_l2_norm must be a finite number >= 0, got -inf"),
        (([], 1.0, float("inf")), ValueError, "eps must be a finite number >= 0, got inf"),
    ],
)
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        clip_grad_norm_(*args)


def test_sparse_refused():
    p = torch.zeros(3, 2, requires_grad=True)
    p.grad = torch.ones(3, 2).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        clip_grad_norm_([p], 1.0)


# Property-based (hypothesis; the profile in the root conftest.py decides how many examples run).
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
