import math

import pytest
import torch
import torch.nn.functional as F
from attention_numerics import DTYPES, compute_dtype, fixture_ok, output_rounding, seeds, unit_roundoff
from hypothesis import given
from hypothesis import strategies as st

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


# Property-based tests: shapes, batch dimensions, dtypes and seeds are drawn by hypothesis; the profile (root
# conftest.py) decides how many examples run: "ci" by default, ``--hypothesis-profile=thorough``.
def significand_bits(dtype: torch.dtype) -> int:
    return 1 - round(math.log2(torch.finfo(dtype).eps))


@st.composite
def shape_and_dim(draw, max_rank=4, max_side=7):
    shape = tuple(draw(st.lists(st.integers(1, max_side), min_size=1, max_size=max_rank)))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    return shape, dim


def sum_bound(dtype: torch.dtype, n: int) -> float:
    # Σ_i p_i with p_i = e_i / S: S carries at most (n - 1) roundings, exp and the division one or
    # two more (n + 4 units of the compute dtype in all), and a narrow dtype rounds each p_i once,
    # which moves the sum by at most u · Σ p_i = u.
    return (n + 4) * unit_roundoff(compute_dtype(dtype)) + output_rounding(dtype)


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


# Edges that a mutation run found unpinned: 0-d and 1-d inputs.
@pytest.mark.parametrize("dim", [0, -1])
def test_zero_dimensional_input_matches_torch(dim):
    x = torch.tensor(3.5)
    torch.testing.assert_close(softmax(x, dim), torch.softmax(x, dim))


def test_one_dimensional_input_refuses_dim_one():
    with pytest.raises(ValueError, match=r"dim must be in \[-1, 0\] for a tensor of rank 1, got 1"):
        softmax(torch.randn(4), 1)


# softmax in bfloat16 and float16: the reduction runs in float32, so the result is the exact value rounded once to the
# low-precision dtype, give or take one rounding step (one ulp).
LOW = [torch.bfloat16, torch.float16]


def inputs(dtype, scale, seed, n=512):
    g = torch.Generator().manual_seed(seed)
    # scale 30 spreads the logits over ~±120, so the outputs span many binades down to
    # float16's subnormals; n = 512 terms make a low-precision running sum visibly wrong.
    return (torch.randn(3, 5, n, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("scale", [0.1, 1.0, 30.0])
@pytest.mark.parametrize("dim", [-1, 1])
@pytest.mark.parametrize("seed", [0, 1])
def test_low_precision_result_is_float32_math_rounded_once(dtype, scale, dim, seed, ulp_distance):
    x = inputs(dtype, scale, seed)
    out = softmax(x, dim)
    assert out.dtype == dtype
    # float32 math lands within a few hundred float32 ulps (n terms summed) of the exact value,
    # still far below one ulp of the dtype, so it rounds to the exact value's rounding or a neighbour.
    expected = torch.softmax(x.double(), dim).to(dtype)
    assert ulp_distance(out, expected).max().item() <= 1


@pytest.mark.parametrize("dtype", LOW)
def test_reducing_in_low_precision_would_fail_the_one_ulp_check(dtype, ulp_distance):
    # The check above has teeth: the same stable formula evaluated in the dtype throughout is off by more.
    x = inputs(dtype, 1.0, 0)
    e = (x - x.amax(-1, keepdim=True)).exp()
    naive = e / e.sum(-1, keepdim=True)
    expected = torch.softmax(x.double(), -1).to(dtype)
    assert ulp_distance(naive, expected).max().item() > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autocast_changes_nothing(dtype):
    # autocast lowers matmul-like ops only; softmax has none, so it keeps the input dtype and the
    # float32 reduction, and gives bitwise the result it gives outside autocast.
    x = inputs(dtype, 3.0, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = softmax(x, -1)
    assert inside.dtype == dtype
    assert torch.equal(inside, softmax(x, -1))
