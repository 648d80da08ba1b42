import pytest
import torch
import torch.nn.functional as F

from tlm_ffn import SiLUFFN, SwiGLU, default_d_ff


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_silu_between_two_linears(dtype, device):
    ffn = SiLUFFN(32, 80, device=device, dtype=dtype)
    x = torch.randn(2, 5, 32, device=device, dtype=dtype)
    sd = ffn.state_dict()
    expected = F.linear(F.silu(F.linear(x, sd["w1.weight"])), sd["w2.weight"])
    # float32: two matmuls of ≤ 80 terms each accumulate a few ulps; float64 agrees to its own rounding.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ffn(x), expected, **tol)


def test_gradcheck():
    ffn = SiLUFFN(4, 6, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ffn, (x,))


@pytest.mark.parametrize("d_model", [64, 100, 512])
def test_default_width_keys_and_the_closed_form_parameter_counts(d_model):
    ffn = SiLUFFN(d_model)
    assert ffn.d_ff == 4 * d_model
    shapes = {k: tuple(v.shape) for k, v in ffn.state_dict().items()}
    assert shapes == {"w1.weight": (4 * d_model, d_model), "w2.weight": (d_model, 4 * d_model)}
    # 2·d_model·d_ff = 8·d_model² against SwiGLU's 3·d_model·d_ff at d_ff = 64·⌈8·d_model / 192⌉ ≥ 8/3·d_model.
    silu_params = sum(p.numel() for p in ffn.parameters())
    swiglu_params = sum(p.numel() for p in SwiGLU(d_model).parameters())
    assert silu_params == 8 * d_model**2
    assert swiglu_params == 3 * d_model * default_d_ff(d_model)
    assert 0 <= swiglu_params - silu_params < 3 * d_model * 64


def test_bad_sizes():
    with pytest.raises(ValueError, match="d_ff must be positive, got 0"):
        SiLUFFN(8, 0)
    with pytest.raises(TypeError, match="d_model must be an int, got float"):
        SiLUFFN(8.0)
