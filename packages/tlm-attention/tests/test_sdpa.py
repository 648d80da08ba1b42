import math

import pytest
import torch
import torch.nn.functional as F
from attention_numerics import DTYPES, compute_dtype, fixture_ok, seeds, unit_roundoff
from hypothesis import given
from hypothesis import strategies as st

import tlm_attention.sdpa
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


# Property-based (hypothesis; the profile in the root conftest.py decides how many examples run).
@st.composite
def attention_case(draw):
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    queries, keys = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    d_k, d_v = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    mask_kind = draw(st.sampled_from(["none", "shared", "per-batch"]))
    dtype = draw(st.sampled_from(DTYPES))
    return batch, queries, keys, d_k, d_v, mask_kind, dtype, draw(seeds)


@fixture_ok
@given(case=attention_case())
def test_sdpa_is_equivariant_to_permuting_keys_and_values_together(case, device):
    batch, queries, keys, d_k, d_v, mask_kind, dtype, seed = case
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    Q, K, V = randn(*batch, queries, d_k), randn(*batch, keys, d_k), randn(*batch, keys, d_v)
    mask = None
    if mask_kind != "none":
        # Some rows come out fully masked; those give zeros on both sides.
        mask_shape = (queries, keys) if mask_kind == "shared" else (*batch, queries, keys)
        mask = (torch.rand(mask_shape, generator=g) < 0.6).to(device)
    perm = torch.randperm(keys, generator=g).to(device)

    out = scaled_dot_product_attention(Q, K, V, mask)
    permuted = scaled_dot_product_attention(
        Q, K[..., perm, :], V[..., perm, :], None if mask is None else mask[..., perm]
    )
    assert permuted.dtype == dtype and permuted.shape == out.shape

    # Permuting keys only reorders sums; with exact arithmetic the outputs would be equal. Bound
    # the reordering, relative to max|V| (every output is a convex combination of rows of V):
    # - each score Q·K / sqrt(d_k) may be accumulated in another order: at most γ_dk = d_k·u of
    #   Σ|q||k| / sqrt(d_k), and a score error δ moves the output by at most 2δ·max|V|;
    # - the softmax normaliser (n = keys terms, compute dtype) and the weighted sum of V (n terms,
    #   accumulated in the dtype at worst): (n + 1) units each, on both sides;
    # - a narrow dtype rounds the weights and the output: one ulp (eps) each.
    u, u_c, eps = unit_roundoff(dtype), unit_roundoff(compute_dtype(dtype)), torch.finfo(dtype).eps
    score_err = d_k * u * (Q.double().abs() @ K.double().abs().transpose(-1, -2)).max().item() / math.sqrt(d_k)
    vmax = V.double().abs().max().item()
    atol = vmax * (2 * 2 * score_err + 2 * (keys + 1) * (u + u_c) + (2 * eps if dtype != compute_dtype(dtype) else 0))
    torch.testing.assert_close(permuted.double(), out.double(), rtol=0, atol=atol)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_sdpa_refuses_a_non_tensor_with_a_type_error(which):
    args = [torch.randn(2, 4), torch.randn(3, 4), torch.randn(3, 4)]
    args[which] = args[which].tolist()
    with pytest.raises(TypeError, match=f"{'QKV'[which]} must be a torch.Tensor, got list"):
        scaled_dot_product_attention(*args)


# The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import hook with beartype)
# a wrong-shaped tensor is refused by the annotation itself.
def test_queries_and_keys_of_different_d_k_are_refused_by_the_annotation(shape_checks):
    q, k, v = torch.randn(3, 4), torch.randn(5, 6), torch.randn(5, 2)  # d_k: 4 in Q, 6 in K
    shape_checks(tlm_attention.sdpa, lambda: scaled_dot_product_attention(q, k, v))
