import pytest
import torch
import torch.nn.functional as F

from tlm_attention import blockwise_attention


def bottom_right_causal(num_q: int, num_k: int) -> torch.Tensor:
    return torch.ones(num_q, num_k, dtype=torch.bool).tril(num_k - num_q)


@pytest.mark.parametrize(
    "num_q, num_k, block",
    [(37, 37, 8), (64, 64, 16), (5, 13, 4), (1, 9, 4), (9, 9, 256), (3, 3, 1)],
)
@pytest.mark.parametrize("causal", [True, False])
def test_forward_and_gradients_match_torch_sdpa_in_float64(num_q, num_k, block, causal):
    q = torch.randn(2, 3, num_q, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, num_k, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, num_k, 5, dtype=torch.float64, requires_grad=True)
    mask = bottom_right_causal(num_q, num_k) if causal else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = blockwise_attention(q, k, v, causal=causal, block_size=block)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    for got, want in zip(
        torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_float32_matches_torch(device):
    q, k, v = (torch.randn(2, 4, 300, 32, device=device) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(blockwise_attention(q, k, v, block_size=64), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_computed_in_float32(dtype):
    q, k, v = (torch.randn(1, 2, 40, 16).to(dtype) for _ in range(3))
    out = blockwise_attention(q, k, v, block_size=16)
    assert out.dtype == dtype
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(dtype)
    torch.testing.assert_close(out, expected)  # assert_close's per-dtype tolerance: one rounding step


def test_gradcheck():
    q, k, v = (torch.randn(1, 2, 7, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: blockwise_attention(q, k, v, block_size=3), (q, k, v))


def test_queries_with_no_visible_key_give_zeros():
    # More queries than keys: under bottom-right alignment the first two queries see nothing.
    q = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    out = blockwise_attention(q, k, v, block_size=2)
    torch.testing.assert_close(out[:2], torch.zeros(2, 2, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(out[2:], F.scaled_dot_product_attention(q[2:], k, v, is_causal=True))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_inputs_not_modified():
    q, k, v = (torch.randn(2, 9, 4) for _ in range(3))
    copies = [t.clone() for t in (q, k, v)]
    blockwise_attention(q, k, v, block_size=4)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), copies, strict=True))


@pytest.mark.parametrize(
    "shapes, kwargs, exc, match",
    [
        (((2, 3, 4), (1, 3, 4), (1, 3, 4)), {}, ValueError, "Q, K and V must share their leading dimensions"),
        (((1, 3, 4), (1, 3, 5), (1, 3, 4)), {}, ValueError, "Q and K must share their last dimension d_k"),
        (((1, 3, 4), (1, 3, 4), (1, 2, 4)), {}, ValueError, "K and V must have the same number of keys"),
        (((3, 4), (3, 4), (3, 4)), {"block_size": 0}, ValueError, "block_size must be positive, got 0"),
        (((3, 4), (3, 4), (3, 4)), {"block_size": True}, TypeError, "block_size must be an int, got bool"),
        (((3, 4), (3, 4), (3, 4)), {"block_size": 2.0}, TypeError, "block_size must be an int, got float"),
        (((4,), (3, 4), (3, 4)), {}, ValueError, r"Q must have shape \(..., seq, dim\)"),
    ],
)
def test_bad_input(shapes, kwargs, exc, match):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(exc, match=match):
        blockwise_attention(q, k, v, **kwargs)


# The blockwise attention's forward and backward when queries outnumber keys (issue 9, item 6). Bottom-right alignment
# gives the first ``queries - keys`` rows no visible key: their output and gradients are zero. The reference is
# torch's SDPA in float64 on the rows that do see a key, and zeros on the others (torch's SDPA returns NaN for a row
# with nothing to attend to).
def _reference(q, k, v, causal):
    num_q, num_k = q.shape[-2], k.shape[-2]
    if not causal:
        return F.scaled_dot_product_attention(q, k, v)
    blind = max(num_q - num_k, 0)  # rows with no visible key under bottom-right alignment
    mask = torch.ones(num_q, num_k, dtype=torch.bool).tril(num_k - num_q)[blind:]
    seen = F.scaled_dot_product_attention(q[..., blind:, :], k, v, attn_mask=mask)
    return torch.cat([torch.zeros(*q.shape[:-2], blind, v.shape[-1], dtype=q.dtype), seen], dim=-2)


@pytest.mark.parametrize(
    "num_q, num_k, block",
    [(13, 5, 4), (9, 1, 2), (16, 8, 8), (11, 7, 3), (40, 17, 16), (6, 2, 256), (5, 4, 1)],
)
@pytest.mark.parametrize("causal", [True, False])
def test_more_queries_than_keys_forward_and_backward_match_float64_sdpa(num_q, num_k, block, causal):
    q = torch.randn(2, 3, num_q, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, num_k, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, num_k, 6, dtype=torch.float64, requires_grad=True)
    expected = _reference(q, k, v, causal)
    out = blockwise_attention(q, k, v, causal=causal, block_size=block)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(expected, (q, k, v), grad)
    for name, got, want in zip("qkv", got_grads, want_grads, strict=True):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"grad {name}")


def test_blind_rows_get_zero_output_and_zero_query_gradient():
    q = torch.randn(1, 1, 7, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = blockwise_attention(q, k, v, causal=True, block_size=2)
    assert torch.equal(out[..., :4, :], torch.zeros_like(out[..., :4, :]))
    (grad_q,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(grad_q[..., :4, :], torch.zeros_like(grad_q[..., :4, :]))
    assert (grad_q[..., 4:, :] != 0).any()


def test_gradcheck_with_more_queries_than_keys():
    q = torch.randn(1, 2, 7, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 4, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    for causal in (True, False):
        assert torch.autograd.gradcheck(lambda q, k, v, c=causal: blockwise_attention(q, k, v, c, 3), (q, k, v))


@pytest.mark.parametrize("num_q, num_k", [(5, 13), (1, 9), (12, 12)])
def test_backward_with_keys_ahead_matches_float64_sdpa_for_many_block_sizes(num_q, num_k):
    # Every block size from 1 to past the sequence: the block boundaries move across the diagonal.
    q = torch.randn(1, 2, num_q, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, num_k, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, num_k, 3, dtype=torch.float64, requires_grad=True)
    expected = _reference(q, k, v, True)
    grad = torch.randn_like(expected)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for block in range(1, max(num_q, num_k) + 2):
        out = blockwise_attention(q, k, v, causal=True, block_size=block)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        for got, ref in zip(torch.autograd.grad(out, (q, k, v), grad), want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_default_block_size_and_float32_output_dtype():
    q, k, v = (torch.randn(1, 1, 300, 8) for _ in range(3))
    out = blockwise_attention(q, k, v)
    assert out.dtype == torch.float32
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_integer_input_is_refused():
    t = torch.ones(3, 4, dtype=torch.long)
    with pytest.raises(TypeError, match="Q must be a floating-point tensor, got dtype torch.int64"):
        blockwise_attention(t, t.float(), t.float())
