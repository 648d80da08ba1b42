"""RMSNorm in bfloat16 and float16: the reduction runs in float32, so the result is the exact
value rounded once to the low-precision dtype, give or take one rounding step (one ulp)."""

import pytest
import torch

from tlm_norm import RMSNorm

LOW = [torch.bfloat16, torch.float16]


def float64_rmsnorm(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.double()


def inputs(dtype, scale, seed, d_model=256):
    g = torch.Generator().manual_seed(seed)
    # scale 300: squares reach ~1e6, far beyond float16's 65504; scale 1e-3: squares ~1e-6, below
    # float16's smallest normal (6e-5). Both are harmless only if the squares are taken in float32.
    return (torch.randn(4, 7, d_model, generator=g) * scale).to(dtype)


def with_random_gain(norm, seed):
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.d_model, generator=g) + 0.5)
    return norm


@pytest.mark.parametrize("x_dtype", LOW)
@pytest.mark.parametrize("param_dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_low_precision_result_is_float32_math_rounded_once(x_dtype, param_dtype, scale, seed, ulp_distance):
    norm = with_random_gain(RMSNorm(256, dtype=param_dtype), seed)
    x = inputs(x_dtype, scale, seed)
    out = norm(x)
    assert out.dtype == x_dtype
    # float32 math lands within a few float32 ulps of the exact value, far less than one ulp of
    # x_dtype, so rounding it can differ from rounding the exact value by one step at most.
    expected = float64_rmsnorm(x, norm.weight, norm.eps).to(x_dtype)
    assert ulp_distance(out, expected).max().item() <= 1


@pytest.mark.parametrize("x_dtype", LOW)
def test_reducing_in_low_precision_would_fail_the_one_ulp_check(x_dtype, ulp_distance):
    # The check above has teeth: the same formula evaluated in x_dtype throughout is off by more.
    norm = with_random_gain(RMSNorm(256), 0)
    x = inputs(x_dtype, 1.0, 0)
    w = norm.weight.to(x_dtype)
    naive = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm.eps) * w
    expected = float64_rmsnorm(x, norm.weight.to(x_dtype), norm.eps).to(x_dtype)
    assert ulp_distance(naive, expected).max().item() > 1


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_autocast_changes_nothing(x_dtype, param_dtype):
    # autocast lowers matmul-like ops only; RMSNorm has none, so it keeps the input dtype and the
    # float32 reduction, and gives bitwise the result it gives outside autocast.
    norm = with_random_gain(RMSNorm(256, dtype=param_dtype), 0)
    x = inputs(x_dtype, 1.0, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = norm(x)
    assert inside.dtype == x_dtype
    assert torch.equal(inside, norm(x))
