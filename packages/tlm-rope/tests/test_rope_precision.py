"""RoPE under low precision: the angle tables stay float32 for every position up to max_seq_len,
whatever dtype the module is cast to or the input has, and under autocast."""

import pytest
import torch

from tlm_rope import RotaryPositionalEmbedding


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
