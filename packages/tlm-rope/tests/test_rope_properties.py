"""Property-based tests of RoPE: norm preservation, relative position, identity at position 0.

Shapes, batch dimensions, dtypes, Θ and seeds are drawn by hypothesis; the profile (root
conftest.py) decides how many examples run: "ci" by default, ``--hypothesis-profile=thorough``.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tlm_rope import RotaryPositionalEmbedding

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# The cos/sin tables are float32 whatever the input dtype, so float32 rounding of the table
# entries (and float32 arithmetic for float32 and narrower input) is the floor of every bound.
U32 = 2.0**-24


def unit_roundoff(dtype: torch.dtype) -> float:
    """Largest relative error of rounding a real number to ``dtype`` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def output_rounding(dtype: torch.dtype) -> float:
    # float64 input is rotated in float64 and float32 input in float32: the arithmetic error is
    # counted in the U32 terms below. Narrower dtypes add one final rounding of every element.
    return unit_roundoff(dtype) if torch.finfo(dtype).bits < 32 else 0.0


# The `device` fixture only names a device, so sharing it across examples is safe.
fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def rope_cases(draw):
    d_k = 2 * draw(st.integers(1, 16))
    max_seq_len = draw(st.integers(1, 64))
    seq = draw(st.integers(1, max_seq_len))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    theta = draw(st.sampled_from([2.0, 100.0, 10_000.0, 500_000.0]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    return d_k, max_seq_len, seq, batch, theta, dtype, seed


def random_input(shape, dtype, generator, device):
    """Random signs times magnitudes log-uniform in [1e-2, 1e2]: inside float16's normal range,
    so the relative-rounding arguments behind the bounds below hold for every element."""
    magnitude = 10 ** torch.empty(shape, dtype=torch.float64).uniform_(-2, 2, generator=generator)
    sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1
    return (sign * magnitude).to(device=device, dtype=dtype)


@fixture_ok
@given(case=rope_cases())
def test_rotation_preserves_the_norm_of_every_pair(case, device):
    d_k, max_seq_len, seq, batch, theta, dtype, seed = case
    g = torch.Generator().manual_seed(seed)
    rope = RotaryPositionalEmbedding(theta, d_k, max_seq_len, device=device)
    x = random_input((*batch, seq, d_k), dtype, g, device)
    positions = torch.randint(0, max_seq_len, (seq,), generator=g).to(device)
    out = rope(x, positions)
    assert out.dtype == dtype and out.shape == x.shape

    def pair_norms(t):
        return t.double().unflatten(-1, (d_k // 2, 2)).norm(dim=-1)

    # Per pair: the stored cos²+sin² is 1 within 2·U32 (a factor 1 ± U32 on the norm), the two
    # float32 products and one sum add at most 4·U32, and a narrow dtype rounds each output
    # element once. Pair norms are stronger than the vector norm, which follows from them.
    rtol = output_rounding(dtype) + 6 * U32
    torch.testing.assert_close(pair_norms(out), pair_norms(x), rtol=rtol, atol=0)
    torch.testing.assert_close(out.double().norm(dim=-1), x.double().norm(dim=-1), rtol=rtol, atol=0)


@fixture_ok
@given(case=rope_cases(), data=st.data())
def test_dot_product_depends_only_on_the_position_offset(case, data, device):
    d_k, max_seq_len, seq, batch, theta, dtype, seed = case
    g = torch.Generator().manual_seed(seed)
    rope = RotaryPositionalEmbedding(theta, d_k, max_seq_len, device=device)
    q = random_input((*batch, seq, d_k), dtype, g, device)
    k = random_input((*batch, seq, d_k), dtype, g, device)
    # Positions i (for q) and j (for k) and a common shift s, all inside [0, max_seq_len).
    shift = data.draw(st.integers(0, max_seq_len - 1), label="shift")
    pos_q = torch.randint(0, max_seq_len - shift, (seq,), generator=g).to(device)
    pos_k = torch.randint(0, max_seq_len - shift, (seq,), generator=g).to(device)

    def dot(i, j):
        return (rope(q, i).double() * rope(k, j).double()).sum(-1)

    # Each side is <R_i q, R_j k> up to: a narrow dtype's rounding of each rotated element
    # (2·u relative to |q||k|, one u for each factor) and the float32 tables and arithmetic
    # (≤ 8·U32). The two sides each carry that error, hence the factor 2.
    bound = 2 * (2 * output_rounding(dtype) + 8 * U32) * q.double().norm(dim=-1) * k.double().norm(dim=-1)
    diff = (dot(pos_q, pos_k) - dot(pos_q + shift, pos_k + shift)).abs()
    assert (diff <= bound).all(), f"max excess {(diff - bound).max().item():.3e}"


@fixture_ok
@given(case=rope_cases())
def test_position_zero_is_the_identity(case, device):
    d_k, max_seq_len, seq, batch, theta, dtype, seed = case
    g = torch.Generator().manual_seed(seed)
    rope = RotaryPositionalEmbedding(theta, d_k, max_seq_len, device=device)
    x = random_input((*batch, seq, d_k), dtype, g, device)
    # cos 0 = 1 and sin 0 = 0 are exact in every format, so x·1 - y·0 is x exactly: bitwise equal.
    assert torch.equal(rope(x, torch.zeros(seq, dtype=torch.long, device=device)), x)
    # Without positions, a one-token input sits at position 0.
    assert torch.equal(rope(x[..., :1, :]), x[..., :1, :])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_relative_position_bound_catches_an_off_by_one_rotation(dtype):
    # The tolerance has teeth: rotating q one position too far (i + 2 against j + 1) breaks the
    # relative-position bound on most rows in every dtype: by ~1e4-1e5x in float32 and float64,
    # by ~1-20x in bfloat16, whose coarse rounding makes the bound itself wide.
    rope = RotaryPositionalEmbedding(10_000.0, 16, 32)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(8, 16, generator=g).to(dtype) for _ in range(2))
    i, j = torch.arange(8), torch.arange(8) + 3

    def dot(a, b):
        return (rope(q, a).double() * rope(k, b).double()).sum(-1)

    bound = 2 * (2 * output_rounding(dtype) + 8 * U32) * q.double().norm(dim=-1) * k.double().norm(dim=-1)
    caught = (dot(i, j) - dot(i + 2, j + 1)).abs() > bound
    assert caught.float().mean() > 0.5
