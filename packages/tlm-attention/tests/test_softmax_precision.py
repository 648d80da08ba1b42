"""softmax in bfloat16 and float16: the reduction runs in float32, so the result is the exact
value rounded once to the low-precision dtype, give or take one rounding step (one ulp)."""

import pytest
import torch

from tlm_attention import softmax

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
