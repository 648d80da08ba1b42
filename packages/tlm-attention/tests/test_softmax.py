import pytest
import torch
import torch.nn.functional as F

from tlm_attention import softmax


@pytest.mark.parametrize("shape, dim", [((5,), 0), ((3, 4), -1), ((3, 4), 0), ((2, 3, 4), 1), ((2, 3, 4), -3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_f_softmax(shape, dim, dtype, device):
    x = torch.randn(shape, device=device, dtype=dtype) * 4
    out = softmax(x, dim)
    assert out.dtype == dtype
    torch.testing.assert_close(out, F.softmax(x, dim=dim))


def test_shift_invariance():
    # Multiples of 1/16 survive "+ 1000" exactly in float32, so only softmax itself can differ.
    x = torch.randint(-64, 64, (4, 9)) / 16
    torch.testing.assert_close(softmax(x + 1000, -1), softmax(x, -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(softmax(x + 1000, -1), F.softmax(x.double(), -1).float(), rtol=1e-6, atol=1e-6)


def test_extreme_values_stay_finite():
    x = torch.tensor([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4], [3e38, 3e38, -3e38]])
    out = softmax(x, -1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(3))
    torch.testing.assert_close(out, F.softmax(x, -1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    x = (torch.randn(8, 128) * 30).to(dtype)
    out = softmax(x, -1)
    assert out.dtype == dtype
    torch.testing.assert_close(out, F.softmax(x.float(), -1).to(dtype))


def test_partially_masked_slices_match_torch():
    x = torch.randn(3, 5)
    x[0, 1:] = float("-inf")
    x[2, :2] = float("-inf")
    torch.testing.assert_close(softmax(x, -1), F.softmax(x, -1))


def test_all_neg_inf_slice_is_zero_with_zero_gradient():
    x = torch.randn(3, 4, dtype=torch.float64)
    x[1] = float("-inf")
    x.requires_grad_(True)
    out = softmax(x, -1)
    torch.testing.assert_close(out[1], torch.zeros(4, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(out[[0, 2]], F.softmax(x.detach()[[0, 2]], -1))
    (out * torch.randn_like(out)).sum().backward()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad[1], torch.zeros(4, dtype=torch.float64), rtol=0, atol=0)


def test_gradcheck():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: softmax(x, 1), (x,))
    assert torch.autograd.gradcheck(lambda x: softmax(x, 0), (x,))


def test_input_not_modified():
    x = torch.randn(4, 4)
    before = x.clone()
    softmax(x, -1)
    assert torch.equal(x, before)


@pytest.mark.parametrize(
    "x, dim, exc, match",
    [
        (torch.randn(2, 3), 2, ValueError, r"dim must be in \[-2, 1\] for a tensor of rank 2, got 2"),
        (torch.randn(2, 3), -3, ValueError, "got -3"),
        (torch.randn(2, 3), 1.0, TypeError, "dim must be an int, got float"),
        (torch.arange(3), 0, TypeError, "floating-point tensor, got dtype torch.int64"),
        ([1.0, 2.0], 0, TypeError, "x must be a torch.Tensor, got list"),
    ],
)
def test_bad_input(x, dim, exc, match):
    with pytest.raises(exc, match=match):
        softmax(x, dim)
