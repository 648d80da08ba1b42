"""Targets of -100 (IGNORE_INDEX) are skipped by the chunked loss as F.cross_entropy's ignore_index skips them."""

import pytest
import torch
import torch.nn.functional as F

from tlm_model import chunked_cross_entropy
from tlm_model.loss import IGNORE_INDEX


@pytest.mark.parametrize("chunk_size", [1, 5, 48])
def test_ignored_targets_match_f_cross_entropy_loss_and_gradients(chunk_size):
    torch.manual_seed(0)
    hidden = torch.randn(48, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 30, (48,))
    targets[torch.rand(48) < 0.4] = IGNORE_INDEX
    got = chunked_cross_entropy(hidden, weight, targets, chunk_size)
    expected = F.cross_entropy(hidden @ weight.T, targets, ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(2.0 * got, (hidden, weight))
    expected_grads = torch.autograd.grad(2.0 * expected, (hidden, weight))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # the forward-only path too
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, targets, chunk_size), expected.detach())


def test_every_target_ignored_gives_zero_loss_and_zero_gradients_not_nan():
    hidden = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    loss = chunked_cross_entropy(hidden, weight, torch.full((6,), IGNORE_INDEX), 4)
    loss.backward()
    assert loss.item() == 0.0 and not hidden.grad.any() and not weight.grad.any()
