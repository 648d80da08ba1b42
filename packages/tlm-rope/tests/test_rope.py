import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tlm_rope.rope
from tlm_rope import RotaryPositionalEmbedding


def block_diagonal_rotation(position: int, d: int, theta: float) -> torch.Tensor:
    """R^i of CS336 eq. (8)-(9), built entry by entry in float64."""
    r = torch.zeros(d, d, dtype=torch.float64)
    for k in range(d // 2):
        angle = position / theta ** (2 * k / d)
        c, s = math.cos(angle), math.sin(angle)
        r[2 * k, 2 * k], r[2 * k, 2 * k + 1] = c, -s
        r[2 * k + 1, 2 * k], r[2 * k + 1, 2 * k + 1] = s, c
    return r


def test_matches_block_diagonal_matrix():
    d, seq, theta = 8, 6, 10_000.0
    rope = RotaryPositionalEmbedding(theta, d, max_seq_len=seq)
    x = torch.randn(seq, d, dtype=torch.float64)
    expected = torch.stack([block_diagonal_rotation(i, d, theta) @ x[i] for i in range(seq)])
    torch.testing.assert_close(rope(x), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "x_shape, pos_shape",
    [((5, 16), None), ((3, 5, 16), (5,)), ((3, 5, 16), (3, 5)), ((2, 4, 5, 16), (2, 1, 5)), ((2, 4, 5, 16), None)],
)
def test_matches_complex_multiplication(x_shape, pos_shape, device, rope_reference):
    rope = RotaryPositionalEmbedding(500.0, 16, max_seq_len=64, device=device)
    x = torch.randn(x_shape, device=device)
    if pos_shape is None:
        positions = None
        ref_positions = torch.arange(x_shape[-2], device=device)
    else:
        positions = torch.randint(0, 64, pos_shape, device=device)
        ref_positions = positions
    out = rope(x, positions)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), rope_reference(x, ref_positions, 500.0), rtol=1e-5, atol=1e-6)


def test_far_positions_keep_float32_accuracy(rope_reference):
    # Angles come from float64, so even position 16383 is within float32 rounding of the truth.
    rope = RotaryPositionalEmbedding(10_000.0, 64, max_seq_len=16_384)
    x = torch.randn(4, 64)
    positions = torch.tensor([0, 1, 8191, 16383])
    torch.testing.assert_close(
        rope(x, positions).double(), rope_reference(x, positions, 10_000.0), rtol=1e-5, atol=2e-6
    )


# Identity at position 0, norm preservation and relative position: the property-based tests below.


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_rotates_in_float32(dtype, rope_reference):
    rope = RotaryPositionalEmbedding(10_000.0, 16, max_seq_len=512)
    x = torch.randn(512, 16).to(dtype)
    out = rope(x)
    assert out.dtype == dtype
    expected = rope_reference(x.float(), torch.arange(512), 10_000.0).to(dtype)
    torch.testing.assert_close(out, expected)


def test_buffers_are_float32_non_persistent_and_not_parameters():
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=16)
    assert list(rope.parameters()) == []
    assert rope.state_dict() == {}
    assert rope.cos.shape == rope.sin.shape == (16, 4)
    assert rope.cos.dtype == rope.sin.dtype == torch.float32


def test_tables_stay_float32_after_module_cast():
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=400)
    reference_cos = rope.cos.clone()
    rope.to(torch.bfloat16)
    assert rope.cos.dtype == torch.float32
    torch.testing.assert_close(rope.cos, reference_cos, rtol=0, atol=0)
    rope.half()
    assert rope.sin.dtype == torch.float32


def test_meta_then_to_empty_rebuilds_tables():
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=32, device="meta")
    assert rope.cos.is_meta
    rope.to_empty(device="cpu")
    fresh = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=32)
    torch.testing.assert_close(rope.cos, fresh.cos, rtol=0, atol=0)
    torch.testing.assert_close(rope.sin, fresh.sin, rtol=0, atol=0)


def test_device_argument(device):
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=4, device=device)
    assert rope.cos.device.type == device.type


def test_gradcheck():
    rope = RotaryPositionalEmbedding(10_000.0, 6, max_seq_len=5)
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: rope(x, torch.tensor([4, 0, 2, 1, 3])), (x,))


def test_input_not_modified():
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=4)
    x = torch.randn(4, 8)
    before = x.clone()
    rope(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((10_000.0, 7, 16), ValueError, "d_k must be even .*got 7"),
        ((0.0, 8, 16), ValueError, "theta must be a finite number > 0, got 0.0"),
        ((10_000.0, 8, 0), ValueError, "max_seq_len must be positive, got 0"),
        ((10_000.0, 8.0, 16), TypeError, "d_k must be an int, got float"),
        (("10000", 8, 16), TypeError, "theta must be a number, got str"),
    ],
)
def test_bad_constructor_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        RotaryPositionalEmbedding(*args)


@pytest.mark.parametrize(
    "positions, exc, match",
    [
        (torch.tensor([0.0, 1.0, 2.0]), RuntimeError, "Expected dtype int32 or int64 for index"),
        (torch.tensor([0, 1]), ValueError, r"shape \(2,\) must broadcast to x.shape\[:-1\] = \(2, 3\)"),
        (torch.zeros(4, 2, 3, dtype=torch.long), ValueError, "must broadcast"),
        ([0, 1, 2], TypeError, "token_positions must be a torch.Tensor, got list"),
    ],
)
def test_bad_positions(positions, exc, match):
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=16)
    with pytest.raises(exc, match=match):
        rope(torch.randn(2, 3, 8), positions)


def test_bad_inputs():
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=4)
    with pytest.raises(ValueError, match="seq=5 positions but the tables hold max_seq_len=4"):
        rope(torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"d_k=8\), got \(4, 6\)"):
        rope(torch.randn(4, 6))
    with pytest.raises(TypeError, match="floating-point tensor"):
        rope(torch.ones(4, 8, dtype=torch.long))


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32]
)
def test_every_integer_dtype_is_a_position_never_a_mask(dtype, rope_reference):
    # uint8 positions would be read as a boolean mask by indexing; uint16/32/64 have no min/max.
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=100)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 1, 0], [99, 3, 50, 7]])
    expected = rope_reference(x, positions, 10_000.0)
    torch.testing.assert_close(rope(x, positions.to(dtype)), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.int8])
def test_out_of_range_positions_are_refused_by_the_lookup(dtype):
    # index_select's kernel refuses them (IndexError), so no value is read back to the host, and a
    # negative position is not wrapped to the end of the tables as indexing would.
    rope = RotaryPositionalEmbedding(10_000.0, 8, 4)
    with pytest.raises(IndexError, match="index out of range in self"):
        rope(torch.randn(2, 8), torch.tensor([1, 4], dtype=dtype))
    if dtype.is_signed:
        with pytest.raises(IndexError, match="index out of range in self"):
            rope(torch.randn(2, 8), torch.tensor([-1, 3], dtype=dtype))


@pytest.mark.slow  # the first torch.compile in a process costs ~7 s of dynamo start-up
def test_out_of_range_positions_are_refused_under_torch_compile():
    torch._dynamo.reset()
    rope = torch.compile(RotaryPositionalEmbedding(10_000.0, 8, 4), backend="aot_eager", fullgraph=True)
    rope(torch.randn(2, 8), torch.tensor([0, 3]))
    with pytest.raises(IndexError, match="index out of range in self"):
        rope(torch.randn(2, 8), torch.tensor([-1, 3]))
    torch._dynamo.reset()


# layout="half", seq_dim=-3 and partial rotary, against the complex-multiplication reference.
def half_to_interleaved(d):
    # Feature k of the first half pairs with k + d/2: interleaving them makes pair (2k, 2k+1).
    return torch.stack([torch.arange(d // 2), torch.arange(d // 2, d)], dim=-1).flatten()


def test_half_layout_is_interleaved_rope_on_permuted_features(rope_reference, record_error):
    d, theta = 16, 10_000.0
    rope = RotaryPositionalEmbedding(theta, d, 32, layout="half")
    x = torch.randn(2, 3, 9, d, dtype=torch.float64)
    positions = torch.randint(0, 32, (2, 1, 9))
    order = half_to_interleaved(d)
    expected = rope_reference(x[..., order], positions, theta)[..., torch.argsort(order)]
    got = rope(x, positions)
    record_error("rope layout=half vs complex reference (float64 x)", got, expected)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_half_layout_matches_hf_apply_rotary_pos_emb():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=64, rope_parameters={"rope_theta": 5e4}
    )
    q, k = torch.randn(2, 2, 4, 10, 32)
    positions = torch.arange(3, 13).expand(2, 10)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    rope = RotaryPositionalEmbedding(5e4, 32, 64, layout="half")
    torch.testing.assert_close(rope(q, positions.unsqueeze(1)), q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope(k, positions.unsqueeze(1)), k_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_seq_dim_minus_3_rotates_by_position_not_head(layout):
    # (batch, seq, heads, d): the torchtune/flash-attn layout. Every head at a position gets the
    # same rotation as the (batch, heads, seq, d) layout gives it.
    torch.manual_seed(0)
    bshd = RotaryPositionalEmbedding(10_000.0, 8, 32, layout=layout, seq_dim=-3)
    bhsd = RotaryPositionalEmbedding(10_000.0, 8, 32, layout=layout)
    x = torch.randn(2, 7, 3, 8)
    expected = bhsd(x.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(bshd(x), expected, rtol=0, atol=0)
    positions = torch.randint(0, 32, (2, 7))
    expected = bhsd(x.transpose(1, 2), positions.unsqueeze(1)).transpose(1, 2)
    torch.testing.assert_close(bshd(x, positions), expected, rtol=0, atol=0)


def test_seq_dim_is_checked():
    with pytest.raises(ValueError, match=r"seq_dim must be -2 .* or -3 .*, got 1"):
        RotaryPositionalEmbedding(10_000.0, 8, 32, seq_dim=1)
    rope = RotaryPositionalEmbedding(10_000.0, 8, 32, seq_dim=-3)
    with pytest.raises(ValueError, match=r"\(\.\.\., seq, heads, d_k=8\), got \(5, 8\)"):
        rope(torch.randn(5, 8))
    with pytest.raises(ValueError, match="must broadcast"):
        rope(torch.randn(2, 5, 3, 8), torch.arange(3))  # positions of the heads axis: refused


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_partial_rotary_rotates_the_first_rotary_dim_features_only(layout, rope_reference):
    rope = RotaryPositionalEmbedding(10_000.0, 16, 32, layout=layout, rotary_dim=6)
    full = RotaryPositionalEmbedding(10_000.0, 6, 32, layout=layout)
    x = torch.randn(3, 11, 16, dtype=torch.float64)
    got = rope(x)
    torch.testing.assert_close(got[..., :6], full(x[..., :6]), rtol=0, atol=0)
    torch.testing.assert_close(got[..., 6:], x[..., 6:], rtol=0, atol=0)
    if layout == "interleaved":
        torch.testing.assert_close(
            got[..., :6], rope_reference(x[..., :6], torch.arange(11), 10_000.0), rtol=1e-6, atol=1e-6
        )


@pytest.mark.parametrize(("rotary_dim", "match"), [(5, "even"), (18, "at most d_k=16"), (0, "positive")])
def test_bad_rotary_dim(rotary_dim, match):
    with pytest.raises(ValueError, match=match):
        RotaryPositionalEmbedding(10_000.0, 16, 32, rotary_dim=rotary_dim)


def test_bad_layout():
    with pytest.raises(ValueError, match=r"layout must be one of \['half', 'interleaved'\], got 'neox'"):
        RotaryPositionalEmbedding(10_000.0, 16, 32, layout="neox")


def test_past_max_seq_len_is_a_clear_error():
    rope = RotaryPositionalEmbedding(10_000.0, 8, 16)
    with pytest.raises(ValueError, match=r"max_seq_len=16"):
        rope(torch.randn(17, 8))


# Edges that a mutation run found unpinned.
def test_empty_positions_with_an_empty_sequence_give_an_empty_result():
    rope = RotaryPositionalEmbedding(10_000.0, 4, 8)
    x = torch.randn(2, 0, 4)
    out = rope(x, torch.zeros(0, dtype=torch.long))
    assert out.shape == (2, 0, 4)


# RoPE under low precision: the angle tables stay float32 for every position up to max_seq_len, whatever dtype the
# module is cast to or the input has, and under autocast.
def float64_angles(max_seq_len, d_k, theta):
    # θ_{i,k} = i · Θ^(-2k/d), written out independently of the module, in float64.
    k = torch.arange(d_k // 2, dtype=torch.float64)
    return torch.arange(max_seq_len, dtype=torch.float64)[:, None] * theta ** (-2 * k / d_k)


@pytest.mark.parametrize("cast", ["bfloat16", "half", "double", "to-float16"])
def test_tables_are_float32_angles_for_every_position_after_any_cast(cast, ulp_distance):
    max_seq_len, d_k, theta = 8192, 64, 10_000.0
    rope = RotaryPositionalEmbedding(theta, d_k, max_seq_len)
    rope = {
        "bfloat16": rope.bfloat16,
        "half": rope.half,
        "double": rope.double,
        "to-float16": lambda: rope.to(torch.float16),
    }[cast]()
    assert rope.cos.dtype == rope.sin.dtype == torch.float32
    angles = float64_angles(max_seq_len, d_k, theta)
    # float64 cos/sin are accurate to ~1e-16, so rounding them to float32 gives the correctly
    # rounded value or (in a near-tie) its neighbour: one float32 ulp at most, at every position.
    assert ulp_distance(rope.cos, angles.cos().float()).max().item() <= 1
    assert ulp_distance(rope.sin, angles.sin().float()).max().item() <= 1


def rotate_float64(x, position, theta):
    """The complex-multiplication form of RoPE in float64: pair k times e^{i·position·Θ^(-2k/d)}."""
    d = x.shape[-1]
    angle = position * theta ** (-2 * torch.arange(d // 2, dtype=torch.float64) / d)
    z = torch.view_as_complex(x.double().unflatten(-1, (d // 2, 2)).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_positions_300_and_301_rotate_as_float32_math_predicts(dtype, ulp_distance):
    # bfloat16 has 8 significant bits: 301 is not representable and rounds to 300, so angles held
    # in bfloat16 could not tell these positions apart. float32 tables can, for any dtype of x.
    assert torch.tensor(301.0).to(torch.bfloat16).item() == 300.0
    theta, d_k = 10_000.0, 64
    rope = RotaryPositionalEmbedding(theta, d_k, max_seq_len=512).to(dtype)
    x = torch.randn(4, 1, d_k, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = {p: rope(x, torch.tensor([p])) for p in (300, 301)}
    for p in (300, 301):
        assert out[p].dtype == dtype
        # float32 tables and arithmetic are ~1e-7 from exact; the result is that, rounded once.
        assert ulp_distance(out[p], rotate_float64(x, p, theta).to(dtype)).max().item() <= 1
    assert not torch.equal(out[300], out[301])
    # The step from 300 to 301 matches float64's, to within one ulp of each output.
    predicted = rotate_float64(x, 301, theta) - rotate_float64(x, 300, theta)
    step = out[301].double() - out[300].double()
    one_ulp_each = torch.finfo(dtype).eps * (out[300].double().abs() + out[301].double().abs())
    assert ((step - predicted).abs() <= one_ulp_each).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autocast_changes_nothing(dtype):
    # autocast lowers matmul-like ops only; RoPE has none, so it gives bitwise the same result.
    rope = RotaryPositionalEmbedding(10_000.0, 32, max_seq_len=1024)
    x = torch.randn(2, 16, 32).to(dtype)
    positions = torch.arange(1000, 1016)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = rope(x, positions)
    assert inside.dtype == dtype
    assert torch.equal(inside, rope(x, positions))


# Property-based tests of RoPE: norm preservation, relative position, identity at position 0. Shapes, batch
# dimensions, dtypes, Θ and seeds are drawn by hypothesis; the profile (root conftest.py) decides how many examples
# run: "ci" by default, ``--hypothesis-profile=thorough``.
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


def rope_and_inputs(case, device, count=1):
    """The case's RoPE module on ``device``, its seeded generator, and ``count`` random (*batch, seq, d_k) inputs."""
    d_k, max_seq_len, seq, batch, theta, dtype, seed = case
    g = torch.Generator().manual_seed(seed)
    rope = RotaryPositionalEmbedding(theta, d_k, max_seq_len, device=device)
    return rope, g, [random_input((*batch, seq, d_k), dtype, g, device) for _ in range(count)]


@fixture_ok
@given(case=rope_cases())
def test_rotation_preserves_the_norm_of_every_pair(case, device):
    rope, g, (x,) = rope_and_inputs(case, device)
    d_k, seq, dtype = rope.d_k, x.shape[-2], x.dtype
    positions = torch.randint(0, rope.max_seq_len, (seq,), generator=g).to(device)
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
    rope, g, (q, k) = rope_and_inputs(case, device, count=2)
    max_seq_len, seq, dtype = rope.max_seq_len, q.shape[-2], q.dtype
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
    rope, _, (x,) = rope_and_inputs(case, device)
    seq = x.shape[-2]
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


# The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import hook with beartype)
# a tensor of the wrong kind is refused by the annotation itself.
def test_floating_point_positions_are_refused_by_the_annotation(shape_checks):
    # The sequence axis moves with seq_dim, so forward's annotation names d_k only; positions must
    # still be an integer tensor (`Integer[Tensor, "..."]`).
    rope = RotaryPositionalEmbedding(10_000.0, 8, 16)
    x, positions = torch.randn(2, 3, 8), torch.arange(3.0)
    shape_checks(tlm_rope.rope, lambda: rope(x, positions))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_start_is_positions_start_onwards(layout):
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=12, layout=layout)
    x = torch.randn(2, 3, 5, 8)
    torch.testing.assert_close(rope(x, start=7), rope(x, torch.arange(7, 12)), rtol=0, atol=0)
    torch.testing.assert_close(rope(x, start=0), rope(x), rtol=0, atol=0)


def test_start_against_the_complex_multiplication_reference(rope_reference):
    rope = RotaryPositionalEmbedding(500.0, 16, max_seq_len=64)
    x = torch.randn(4, 9, 16)
    expected = rope_reference(x, torch.arange(40, 49), 500.0)
    torch.testing.assert_close(rope(x, start=40).double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(start=-1), r"start must be an int >= 0, got -1"),
        (dict(start=True), r"start must be an int >= 0, got True"),
        (dict(start=2, token_positions=torch.arange(3)), r"give token_positions or start, not both \(start=2\)"),
        (dict(start=6), r"x has seq=3 positions from start=6 but the tables hold max_seq_len=8"),
    ],
)
def test_bad_start(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RotaryPositionalEmbedding(10_000.0, 4, 8)(torch.randn(3, 4), **kwargs)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rotation_keeps_the_memory_order_of_its_input(layout):
    # q cut from a (batch, seq, heads·d_k) projection and viewed as (batch, heads, seq, d_k): the
    # rotated q keeps (seq, heads) memory order, so attention's output needs no copy afterwards.
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=16, layout=layout)
    q = torch.randn(2, 16, 3 * 8).unflatten(-1, (3, 8)).transpose(1, 2)
    out = rope(q)
    assert out.stride() == q.stride() == (384, 8, 24, 1)
    torch.testing.assert_close(out, rope(q.contiguous()))  # to rounding: strided and dense loops may differ


def test_module_and_its_tables_save_and_load_whole():
    import io

    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=16)
    buffer = io.BytesIO()
    torch.save(rope, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded(x), rope(x), rtol=0, atol=0)
    torch.testing.assert_close(loaded.cos, rope.cos, rtol=0, atol=0)
