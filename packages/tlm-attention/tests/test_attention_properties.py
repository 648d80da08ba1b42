"""Property-based tests of softmax, scaled dot-product attention and causal multi-head attention.

Shapes, batch dimensions, dtypes and seeds are drawn by hypothesis; the profile (root
conftest.py) decides how many examples run: "ci" by default, ``--hypothesis-profile=thorough``.
"""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tlm_attention import BACKENDS, CausalMultiHeadSelfAttention, scaled_dot_product_attention, softmax
from tlm_rope import RotaryPositionalEmbedding

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

# The `device` fixture only names a device, so sharing it across examples is safe.
fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def unit_roundoff(dtype: torch.dtype) -> float:
    """Largest relative error of rounding a real number to ``dtype`` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # softmax reduces in float32, or in float64 for float64 input.
    return torch.promote_types(dtype, torch.float32)


def output_rounding(dtype: torch.dtype) -> float:
    # The one rounding of a float32 result back to a narrower input dtype (none otherwise).
    return unit_roundoff(dtype) if dtype != compute_dtype(dtype) else 0.0


def significand_bits(dtype: torch.dtype) -> int:
    return 1 - round(math.log2(torch.finfo(dtype).eps))


@st.composite
def shape_and_dim(draw, max_rank=4, max_side=7):
    shape = tuple(draw(st.lists(st.integers(1, max_side), min_size=1, max_size=max_rank)))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    return shape, dim


seeds = st.integers(0, 2**32 - 1)


def sum_bound(dtype: torch.dtype, n: int) -> float:
    # Σ_i p_i with p_i = e_i / S: S carries at most (n - 1) roundings, exp and the division one or
    # two more (n + 4 units of the compute dtype in all), and a narrow dtype rounds each p_i once,
    # which moves the sum by at most u · Σ p_i = u.
    return (n + 4) * unit_roundoff(compute_dtype(dtype)) + output_rounding(dtype)


# ---------------------------------------------------------------------------------------- softmax


@fixture_ok
@given(case=shape_and_dim(), dtype=st.sampled_from(DTYPES), scale=st.sampled_from([1e-3, 1.0, 30.0, 1e3]), seed=seeds)
def test_softmax_sums_to_one(case, dtype, scale, seed, device):
    shape, dim = case
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)
    p = softmax(x, dim)
    assert p.dtype == dtype and p.shape == x.shape
    assert ((p >= 0) & (p <= 1)).all()
    total = p.double().sum(dim)
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=sum_bound(dtype, shape[dim]))


@fixture_ok
@given(case=shape_and_dim(), dtype=st.sampled_from(DTYPES), seed=seeds, data=st.data())
def test_softmax_is_shift_invariant(case, dtype, seed, data, device):
    shape, dim = case
    g = torch.Generator().manual_seed(seed)
    # Quarter-integers with |x|, |c| <= 2^(p-3) for p significand bits: x, c and x + c are exact in
    # the dtype, and so is every x - max(x) in the compute dtype. Both calls then exponentiate the
    # very same numbers, so the results must be bitwise equal: no tolerance is needed.
    limit = 2 ** min(significand_bits(dtype) - 1, 30)
    x = (torch.randint(-limit, limit + 1, shape, generator=g) / 4).to(device=device, dtype=dtype)
    c = data.draw(st.integers(-limit, limit), label="4c") / 4
    shifted = x + c
    assert torch.equal(shifted.double(), x.double() + c), "the shift itself must be exact"
    assert torch.equal(softmax(shifted, dim), softmax(x, dim))


@fixture_ok
@given(case=shape_and_dim(), dtype=st.sampled_from(DTYPES), seed=seeds)
def test_softmax_is_finite_for_inputs_of_plus_minus_1e4(case, dtype, seed, device):
    shape, dim = case
    g = torch.Generator().manual_seed(seed)
    # Each entry is +1e4, -1e4 or uniform in between: exp(1e4) overflows every float format, so
    # only the max-subtraction keeps this finite.
    choice = torch.randint(0, 3, shape, generator=g)
    between = torch.empty(shape, dtype=torch.float64).uniform_(-1e4, 1e4, generator=g)
    x = torch.where(choice == 0, 1e4, torch.where(choice == 1, -1e4, between)).to(device=device, dtype=dtype)
    p = softmax(x, dim)
    assert torch.isfinite(p).all()
    assert ((p >= 0) & (p <= 1)).all()
    total = p.double().sum(dim)
    n = shape[dim]
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=sum_bound(dtype, n))
    # Against float64 on the same (already rounded) input: one rounding to the dtype (rtol), plus
    # the compute dtype's error, which is absolute: a term whose exponent x - max(x) carries a
    # rounding error of u·|x - max(x)| has weight at most e^-|x - max(x)|, and t·e^-t <= 1/e.
    expected = torch.softmax(x.double(), dim)
    torch.testing.assert_close(
        p.double(), expected, rtol=output_rounding(dtype), atol=(n + 4) * unit_roundoff(compute_dtype(dtype))
    )


# ------------------------------------------------------------------------- scaled dot-product attention


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


# ---------------------------------------------------------------------- causal multi-head attention

MHA_DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@st.composite
def mha_case(draw):
    heads = draw(st.integers(1, 4))
    d_head = 2 * draw(st.integers(1, 4))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    seq = draw(st.integers(1, 8))
    rope = draw(st.booleans())
    offset = draw(st.integers(0, 8)) if rope else 0
    options = {"attention_backend": draw(st.sampled_from(BACKENDS)), "fused": draw(st.booleans())}
    return heads, d_head, batch, seq, rope, offset, options, draw(st.sampled_from(MHA_DTYPES)), draw(seeds)


def build_mha(heads, d_head, rope, offset, seq, options, dtype, seed, device):
    torch.manual_seed(seed)  # the module draws its initial weights from the global generator
    d_model = heads * d_head
    table = RotaryPositionalEmbedding(10_000.0, d_head, max_seq_len=16, device=device) if rope else None
    attn = CausalMultiHeadSelfAttention(d_model, heads, rope=table, device=device, dtype=dtype, **options)
    positions = torch.arange(offset, offset + seq, device=device) if rope else None
    return attn, positions


@fixture_ok
@given(case=mha_case(), data=st.data())
def test_mha_output_at_t_ignores_inputs_after_t(case, data, device):
    heads, d_head, batch, seq, rope, offset, options, dtype, seed = case
    attn, positions = build_mha(heads, d_head, rope, offset, seq, options, dtype, seed, device)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, seq, heads * d_head, generator=g).to(device=device, dtype=dtype)
    t = data.draw(st.integers(0, seq - 1), label="t")
    changed = x.clone()
    changed[..., t + 1 :, :] = torch.randn(changed[..., t + 1 :, :].shape, generator=g).to(device=device, dtype=dtype)
    # Later keys get weight exp(-inf) = 0 exactly, and shapes (so kernels) are unchanged: the
    # outputs up to t must be bitwise equal, not merely close.
    assert torch.equal(attn(x, positions)[..., : t + 1, :], attn(changed, positions)[..., : t + 1, :])


@fixture_ok
@given(case=mha_case(), rows=st.integers(2, 4), data=st.data())
def test_mha_batch_row_ignores_other_rows(case, rows, data, device):
    heads, d_head, batch, seq, rope, offset, options, dtype, seed = case
    attn, positions = build_mha(heads, d_head, rope, offset, seq, options, dtype, seed, device)
    g = torch.Generator().manual_seed(seed)
    shape = (rows, *batch, seq, heads * d_head)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    b = data.draw(st.integers(0, rows - 1), label="row")
    changed = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    changed[b] = x[b]
    # Same shapes, so the same kernels: row b's output must be bitwise equal.
    assert torch.equal(attn(x, positions)[b], attn(changed, positions)[b])
