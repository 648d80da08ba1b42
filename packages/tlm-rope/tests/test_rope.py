import math

import pytest
import torch

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


def test_position_zero_is_identity():
    rope = RotaryPositionalEmbedding(10_000.0, 32, max_seq_len=8)
    x = torch.randn(3, 1, 32)
    torch.testing.assert_close(rope(x), x, rtol=0, atol=0)


def test_preserves_norm():
    rope = RotaryPositionalEmbedding(10_000.0, 64, max_seq_len=256)
    x = torch.randn(2, 256, 64, dtype=torch.float64)
    torch.testing.assert_close(rope(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-6, atol=1e-6)


def test_dot_product_depends_only_on_offset():
    rope = RotaryPositionalEmbedding(10_000.0, 32, max_seq_len=128)
    q, k = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)

    def score(i, j):
        return rope(q.view(1, 32), torch.tensor([i])) @ rope(k.view(1, 32), torch.tensor([j])).T

    reference = score(7, 3)
    for shift in (1, 20, 100):
        torch.testing.assert_close(score(7 + shift, 3 + shift), reference, rtol=1e-5, atol=1e-5)


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
        (("10000", 8, 16), TypeError, "theta must be a float, got str"),
    ],
)
def test_bad_constructor_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        RotaryPositionalEmbedding(*args)


@pytest.mark.parametrize(
    "positions, exc, match",
    [
        (torch.tensor([0, 1, 16]), ValueError, r"\[0, max_seq_len=16\), got values in \[0, 16\]"),
        (torch.tensor([-1, 0, 1]), ValueError, r"got values in \[-1, 1\]"),
        (torch.tensor([0.0, 1.0, 2.0]), TypeError, "integer tensor, got dtype torch.float32"),
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
def test_out_of_range_positions_of_narrow_dtypes_are_refused(dtype):
    with pytest.raises(ValueError, match=r"token_positions must lie in \[0, max_seq_len=4\), got values in \[1, 9\]"):
        RotaryPositionalEmbedding(10_000.0, 8, 4)(torch.randn(2, 8), torch.tensor([1, 9], dtype=dtype))


def test_out_of_range_positions_are_refused_under_torch_compile():
    torch._dynamo.reset()
    rope = torch.compile(RotaryPositionalEmbedding(10_000.0, 8, 4), backend="aot_eager", fullgraph=True)
    rope(torch.randn(2, 8), torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match=r"token_positions must lie in \[0, max_seq_len=4\)"):
        rope(torch.randn(2, 8), torch.tensor([-1, 3]))
    torch._dynamo.reset()


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
