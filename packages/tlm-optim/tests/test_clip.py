"""clip_grad_norm_ against torch.nn.utils.clip_grad_norm_."""

import pytest
import torch

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
