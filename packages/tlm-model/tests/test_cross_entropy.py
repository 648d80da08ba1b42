"""cross_entropy against F.cross_entropy (float32, large logits, bfloat16) and a float64 derivation."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from tlm_model import cross_entropy


@pytest.mark.parametrize("scale", [1.0, 100.0, 1e4])
def test_matches_torch_float32(scale, record_error):
    logits = torch.randn(6, 5, 50) * scale
    targets = torch.randint(0, 50, (6, 5))
    ours = cross_entropy(logits, targets)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    record_error(f"cross_entropy vs F.cross_entropy, float32 logits x{scale:g}", ours, expected)
    assert torch.isfinite(ours)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6 * scale)


def test_matches_float64_derivation(record_error):
    logits = torch.randn(32, 100) * 1e4
    targets = torch.randint(0, 100, (32,))
    x = logits.double()
    expected = (torch.logsumexp(x, dim=-1) - x[torch.arange(32), targets]).mean()
    ours = cross_entropy(logits, targets)
    record_error("cross_entropy float32 vs float64 logsumexp, logits up to 1e4", ours, expected)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=0)


def test_bfloat16_is_computed_in_float32(record_error):
    logits = (torch.randn(8, 300) * 20).to(torch.bfloat16)
    targets = torch.randint(0, 300, (8,))
    ours = cross_entropy(logits, targets)
    expected = F.cross_entropy(logits.float(), targets)
    assert ours.dtype == torch.float32
    record_error("cross_entropy bfloat16 vs F.cross_entropy in float32", ours, expected)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)


def test_gradient_matches_torch(record_error):
    logits = (torch.randn(4, 7, 30) * 50).requires_grad_()
    ref = logits.detach().clone().requires_grad_()
    targets = torch.randint(0, 30, (4, 7))
    cross_entropy(logits, targets).backward()
    F.cross_entropy(ref.flatten(0, 1), targets.flatten()).backward()
    record_error("cross_entropy gradient vs F.cross_entropy", logits.grad, ref.grad)
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-7)


def test_course_shape_and_unsigned_targets():
    logits = torch.randn(8, 5)
    targets = torch.randint(0, 5, (8,), dtype=torch.uint8)
    expected = F.cross_entropy(logits, targets.long())
    torch.testing.assert_close(cross_entropy(logits, targets), expected)


def test_inputs_not_modified():
    logits, targets = torch.randn(3, 4), torch.tensor([0, 3, 1])
    before = logits.clone()
    cross_entropy(logits, targets)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    ("logits", "targets", "error", "match"),
    [
        (torch.randn(3, 4), torch.tensor([0, 1, 4]), ValueError, r"\[0, vocab=4\)"),
        (torch.randn(3, 4), torch.tensor([0, -1, 2]), ValueError, "targets must lie"),
        (torch.randn(3, 4), torch.tensor([0.0, 1.0, 2.0]), TypeError, "targets must be an integer"),
        (torch.randint(0, 4, (3, 4)), torch.tensor([0, 1, 2]), TypeError, "logits must be a floating"),
        (torch.randn(3, 4), torch.tensor([0, 1]), ValueError, "shape of logits"),
        (torch.randn(0, 4), torch.zeros(0, dtype=torch.long), ValueError, "at least one token"),
        ([[0.0, 1.0]], torch.tensor([0]), TypeError, "Tensors"),
    ],
)
def test_bad_input(logits, targets, error, match):
    with pytest.raises(error, match=match):
        cross_entropy(logits, targets)


@given(st.integers(1, 6), st.integers(2, 40), st.floats(1e-3, 1e4), st.integers(0, 2**16))
def test_property_matches_torch_and_is_nonnegative(rows, vocab, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    ours = cross_entropy(logits, targets)
    assert ours >= 0
    torch.testing.assert_close(ours, F.cross_entropy(logits, targets), rtol=1e-12, atol=1e-12)
