"""SwiGLU edges that a mutation run found unpinned."""

import pytest
import torch
import torch.nn.functional as F

from tlm_ffn import SwiGLU, default_d_ff


def test_default_d_ff_refuses_bools():
    with pytest.raises(TypeError, match="d_model must be an int, got bool"):
        default_d_ff(True)
    with pytest.raises(TypeError, match="multiple_of must be an int, got bool"):
        default_d_ff(8, multiple_of=True)


@pytest.mark.parametrize("kwargs, name", [(dict(d_model=8.0, d_ff=4), "d_model"), (dict(d_model=8, d_ff=4.0), "d_ff")])
def test_float_sizes_are_a_type_error_naming_the_argument(kwargs, name):
    with pytest.raises(TypeError, match=f"{name} must be an int, got float"):
        SwiGLU(**kwargs)


@pytest.mark.parametrize("fused", [False, True])
def test_width_one_is_valid(fused):
    ffn = SwiGLU(1, 1, fused=fused).double()
    sd = ffn.state_dict()
    x = torch.randn(5, 1, dtype=torch.float64)
    expected = F.linear(F.silu(F.linear(x, sd["w1.weight"])) * F.linear(x, sd["w3.weight"]), sd["w2.weight"])
    torch.testing.assert_close(ffn(x), expected)
