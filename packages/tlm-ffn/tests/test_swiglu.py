import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import tlm_ffn.swiglu
from tlm_ffn import SwiGLU, default_d_ff, silu, silu_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_silu_matches_torch(dtype, device):
    x = torch.randn(4, 7, device=device, dtype=dtype) * 5
    torch.testing.assert_close(silu(x), F.silu(x))


def test_silu_extremes_are_finite():
    x = torch.tensor([-1e4, -100.0, 0.0, 100.0, 1e4])
    out = silu(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_half_precision(dtype):
    x = torch.randn(64).to(dtype)
    out = silu(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), F.silu(x.float()), rtol=1e-2, atol=1e-2)


def test_silu_gradcheck():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(silu, (x,))


def test_silu_rejects_integers():
    with pytest.raises(TypeError, match="floating-point tensor, got dtype torch.int64"):
        silu(torch.arange(3))


@pytest.mark.parametrize("d_model", [1, 64, 100, 512, 768, 1600, 4096])
def test_default_d_ff_is_smallest_multiple_of_64_at_least_eight_thirds(d_model):
    d_ff = default_d_ff(d_model)
    assert d_ff % 64 == 0
    assert d_ff >= 8 * d_model / 3 > d_ff - 64
    assert d_ff == 64 * math.ceil(8 * d_model / 3 / 64)


@pytest.mark.parametrize("d_model", [1, 100, 512])
def test_default_d_ff_of_the_silu_ffn_is_four_d_model(d_model):
    assert default_d_ff(d_model, kind="silu") == 4 * d_model
    assert default_d_ff(d_model, kind="swiglu") == default_d_ff(d_model)


def test_default_d_ff_bad_input():
    with pytest.raises(ValueError, match=r"kind must be one of \['silu', 'swiglu'\], got 'relu'"):
        default_d_ff(512, kind="relu")
    with pytest.raises(ValueError, match="d_model must be positive, got 0"):
        default_d_ff(0)
    with pytest.raises(TypeError, match="multiple_of must be an int, got float"):
        default_d_ff(512, 64.0)


def test_swiglu_matches_builtin_composition(device):
    ffn = SwiGLU(32, 96, device=device, fused=False)
    x = torch.randn(2, 5, 32, device=device)
    expected = F.linear(F.silu(F.linear(x, ffn.w1.weight)) * F.linear(x, ffn.w3.weight), ffn.w2.weight)
    torch.testing.assert_close(ffn(x), expected, rtol=1e-6, atol=1e-6)


def test_swiglu_default_width_and_keys():
    ffn = SwiGLU(512)
    assert ffn.d_ff == 1408
    shapes = {k: tuple(v.shape) for k, v in ffn.state_dict().items()}
    assert shapes == {"w1.weight": (1408, 512), "w2.weight": (512, 1408), "w3.weight": (1408, 512)}


def test_swiglu_gradcheck():
    ffn = SwiGLU(4, 6, dtype=torch.float64, fused=False)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in ffn.named_parameters()}
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def f(x, w1, w2, w3):
        return functional_call(ffn, {"w1.weight": w1, "w2.weight": w2, "w3.weight": w3}, (x,))

    assert torch.autograd.gradcheck(f, (x, params["w1.weight"], params["w2.weight"], params["w3.weight"]))


def test_swiglu_bad_sizes():
    with pytest.raises(ValueError, match="d_ff must be positive, got 0"):
        SwiGLU(8, 0)


def test_fused_matches_unfused_and_keeps_the_course_keys(device):
    plain = SwiGLU(32, 96, device=device, fused=False)
    fused = SwiGLU(32, 96, device=device, fused=True)
    fused.load_state_dict(plain.state_dict())
    assert set(fused.state_dict()) == {"w1.weight", "w2.weight", "w3.weight"}
    x = torch.randn(3, 5, 32, device=device)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-6)
    back = SwiGLU(32, 96, device=device, fused=False)
    back.load_state_dict(fused.state_dict())
    torch.testing.assert_close(back.w1.weight, plain.w1.weight, rtol=0, atol=0)


def test_fused_init_matches_separate_matrices():
    fused = SwiGLU(1024, 2048, fused=True)
    sigma = math.sqrt(2 / (1024 + 2048))
    for half in fused.w13.weight.detach().double().chunk(2):
        assert half.abs().max().item() <= 3 * sigma
        assert half.std().item() == pytest.approx(0.98658 * sigma, rel=0.02)


def test_silu_mul_matches_the_two_ops_and_gradchecks():
    gate = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    up = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(silu_mul(gate, up), F.silu(gate) * up)
    assert torch.autograd.gradcheck(silu_mul, (gate, up))
    before = gate.detach().clone(), up.detach().clone()
    with torch.no_grad():
        torch.testing.assert_close(silu_mul(gate, up), F.silu(gate) * up)
    assert torch.equal(gate, before[0]) and torch.equal(up, before[1]), "inputs must not change"


def test_default_is_fused_and_pickles_whole():
    import io
    import pickle

    ffn = SwiGLU(8, 16)
    assert ffn.fused and hasattr(ffn, "w13")
    x = torch.randn(3, 8)
    buffer = io.BytesIO()
    torch.save(ffn, buffer)
    buffer.seek(0)
    for copy in (pickle.loads(pickle.dumps(ffn)), torch.load(buffer, weights_only=False)):
        torch.testing.assert_close(copy(x), ffn(x), rtol=0, atol=0)
        assert set(copy.state_dict()) == {"w1.weight", "w2.weight", "w3.weight"}


# Edges that a mutation run found unpinned.
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


# The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import hook with beartype)
# a wrong-shaped tensor is refused by the annotation itself.
def test_a_tensor_without_the_model_axis_is_refused_by_the_annotation(shape_checks):
    ffn = SwiGLU(4, 8)
    shape_checks(tlm_ffn.swiglu, lambda: ffn(torch.tensor(1.0)))  # "... d_model" needs one axis at least
