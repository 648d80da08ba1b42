import pytest
import torch
import torch.nn.functional as F

from tlm_attention import scaled_dot_product_attention


@pytest.mark.parametrize(
    "q_shape, k_shape, v_dim",
    [((4, 8), (6, 8), 8), ((2, 4, 8), (2, 6, 8), 5), ((2, 3, 4, 16), (2, 3, 7, 16), 16)],
)
@pytest.mark.parametrize("with_mask", [False, True])
def test_matches_torch_sdpa(q_shape, k_shape, v_dim, with_mask, device):
    Q = torch.randn(q_shape, device=device)
    K = torch.randn(k_shape, device=device)
    V = torch.randn(*k_shape[:-1], v_dim, device=device)
    mask = None
    if with_mask:
        mask = torch.rand(q_shape[-2], k_shape[-2], device=device) > 0.3
        mask[:, 0] = True  # no fully masked row here; that case has its own test
    out = scaled_dot_product_attention(Q, K, V, mask)
    expected = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    assert out.shape == (*q_shape[:-1], v_dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_float64_rederivation():
    Q, K, V = (torch.randn(2, 5, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    scores = Q @ K.transpose(-1, -2) / 2.0
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.exp() / scores.exp().sum(-1, keepdim=True)
    torch.testing.assert_close(scaled_dot_product_attention(Q, K, V, mask), weights @ V, rtol=1e-12, atol=1e-12)


def test_mask_broadcasts_over_heads_and_batch():
    Q, K, V = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    per_batch = torch.rand(2, 1, 5, 6) > 0.2
    per_batch[..., 0] = True
    expected = F.scaled_dot_product_attention(Q, K, V, attn_mask=per_batch)
    torch.testing.assert_close(scaled_dot_product_attention(Q, K, V, per_batch), expected, rtol=1e-5, atol=1e-6)


def test_fully_masked_row_gives_zeros_and_finite_gradients():
    Q = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    K = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    V = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    out = scaled_dot_product_attention(Q, K, V, mask)
    torch.testing.assert_close(out[2], torch.zeros(3, dtype=torch.float64), rtol=0, atol=0)
    keep = [0, 1, 3]
    torch.testing.assert_close(out[keep], F.scaled_dot_product_attention(Q[keep], K, V))
    out.sum().backward()
    for t in (Q, K, V):
        assert torch.isfinite(t.grad).all()
    torch.testing.assert_close(Q.grad[2], torch.zeros(8, dtype=torch.float64), rtol=0, atol=0)


def test_gradcheck():
    Q, K, V = (torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    assert torch.autograd.gradcheck(lambda q, k, v: scaled_dot_product_attention(q, k, v, mask), (Q, K, V))


def test_inputs_not_modified():
    Q, K, V = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 2)
    mask = torch.ones(3, 5, dtype=torch.bool)
    copies = [t.clone() for t in (Q, K, V, mask)]
    scaled_dot_product_attention(Q, K, V, mask)
    for t, c in zip((Q, K, V, mask), copies, strict=True):
        assert torch.equal(t, c)


@pytest.mark.parametrize(
    "shapes, mask, exc, match",
    [
        (((3, 4), (5, 6), (5, 2)), None, ValueError, r"share their last dimension d_k, got Q \(3, 4\) and K \(5, 6\)"),
        (((3, 4), (5, 4), (6, 2)), None, ValueError, r"same number of keys .*K \(5, 4\) and V \(6, 2\)"),
        (
            ((3, 4), (5, 4), (5, 2)),
            torch.ones(3, 4, dtype=torch.bool),
            ValueError,
            r"mask of shape \(3, 4\) does not broadcast to .* \(3, 5\)",
        ),
        (((3, 4), (5, 4), (5, 2)), torch.ones(3, 5), TypeError, "mask must have dtype torch.bool .*got torch.float32"),
        (((3, 4), (5, 4), (5, 2)), torch.ones(5, dtype=torch.bool), ValueError, "mask must have shape"),
        (((4,), (5, 4), (5, 2)), None, ValueError, r"Q must have shape \(..., seq, dim\), got \(4,\)"),
    ],
)
def test_bad_input(shapes, mask, exc, match):
    Q, K, V = (torch.randn(s) for s in shapes)
    with pytest.raises(exc, match=match):
        scaled_dot_product_attention(Q, K, V, mask)


def test_leading_dimensions_must_broadcast():
    with pytest.raises(ValueError, match=r"leading .* dimensions of Q \(2, 3, 4\), K \(3, 5, 4\) .* do not broadcast"):
        scaled_dot_product_attention(torch.randn(2, 3, 4), torch.randn(3, 5, 4), torch.randn(3, 5, 2))


def test_integer_input():
    with pytest.raises(TypeError, match="V must be a floating-point tensor, got dtype torch.int64"):
        scaled_dot_product_attention(torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3, dtype=torch.long))
