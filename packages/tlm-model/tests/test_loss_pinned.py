"""chunked_cross_entropy edges that a mutation run found unpinned: gradients wanted for one input
only, bfloat16 inputs, mismatched widths and negative targets. Reference: F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F

from tlm_model import chunked_cross_entropy


@pytest.mark.parametrize("wants", ["hidden", "weight"])
def test_gradient_for_one_input_only(wants):
    hidden = torch.randn(10, 6, dtype=torch.float64, requires_grad=wants == "hidden")
    weight = torch.randn(7, 6, dtype=torch.float64, requires_grad=wants == "weight")
    targets = torch.randint(0, 7, (10,))
    leaf = hidden if wants == "hidden" else weight
    (got,) = torch.autograd.grad(chunked_cross_entropy(hidden, weight, targets, 3), leaf)
    (expected,) = torch.autograd.grad(F.cross_entropy(hidden @ weight.T, targets), leaf)
    torch.testing.assert_close(got, expected)


def test_bfloat16_inputs_are_reduced_in_float32():
    hidden = torch.randn(16, 32).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(50, 32).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (16,))
    loss = chunked_cross_entropy(hidden, weight, targets, 5)
    loss.backward()
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    expected = F.cross_entropy(h32 @ w32.T, targets)
    expected.backward()
    assert loss.dtype == torch.bfloat16 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    # The float32 loss rounded once to bfloat16 (8 bits): within one bfloat16 step of the reference.
    torch.testing.assert_close(loss.float(), expected.detach(), rtol=2**-8, atol=0)
    # Gradients: d loss/d logits is rounded to bfloat16 (unit roundoff 2^-9) before its matmuls and
    # the result once more; normwise that is a few roundoffs, far below what a float32-free path loses.
    for got, want in ((hidden.grad, h32.grad), (weight.grad, w32.grad)):
        assert (got.float() - want).norm() <= 2**-6 * want.norm()


def test_mismatched_widths_are_a_value_error():
    with pytest.raises(ValueError, match=r"hidden must be \(tokens, d_model\) and weight \(vocab, d_model\)"):
        chunked_cross_entropy(torch.randn(4, 8), torch.randn(10, 6), torch.zeros(4, dtype=torch.long))


def test_negative_targets_are_refused():
    with pytest.raises(ValueError, match=r"targets must lie in \[0, vocab=10\), got values in \[-1, 3\]"):
        chunked_cross_entropy(torch.randn(2, 6), torch.randn(10, 6), torch.tensor([-1, 3]))
