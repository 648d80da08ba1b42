import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import tlm_linear.linear
from tlm_linear import Linear


def truncated_normal_std(sigma: float, cut: float) -> float:
    """Closed-form std of N(0, sigma²) truncated to [-cut·sigma, cut·sigma]."""
    pdf = math.exp(-cut * cut / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(cut / math.sqrt(2))
    return sigma * math.sqrt(1 - 2 * cut * pdf / mass)


@pytest.mark.parametrize("lead", [(), (5,), (2, 3), (2, 1, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_f_linear(lead, dtype, device):
    layer = Linear(7, 11, device=device, dtype=dtype)
    x = torch.randn(*lead, 7, device=device, dtype=dtype)
    tol = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}[dtype]
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), **tol)


def test_layout_and_parameters():
    layer = Linear(3, 5)
    assert layer.weight.shape == (5, 3)
    assert [name for name, _ in layer.named_parameters()] == ["weight"]
    assert set(layer.state_dict()) == {"weight"}
    assert not any(isinstance(m, torch.nn.Linear) for m in layer.modules())


def test_does_not_call_f_linear(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("F.linear must not be used")

    monkeypatch.setattr(torch.nn.functional, "linear", forbidden)
    x = torch.randn(4, 3)
    layer = Linear(3, 2)
    expected = torch.einsum("bi,oi->bo", x.double(), layer.weight.double())
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-6, atol=1e-6)


def test_init_statistics():
    d_in, d_out = 1024, 768
    layer = Linear(d_in, d_out)
    sigma = math.sqrt(2 / (d_in + d_out))
    w = layer.weight.detach().double()
    assert w.abs().max().item() <= 3 * sigma
    assert abs(w.mean().item()) < 0.01 * sigma
    assert w.std().item() == pytest.approx(truncated_normal_std(sigma, 3.0), rel=0.02)


def test_device_and_dtype_arguments(device):
    layer = Linear(4, 6, device=device, dtype=torch.float64)
    assert layer.weight.device.type == device.type
    assert layer.weight.dtype == torch.float64


def test_meta_device_allocates_nothing():
    layer = Linear(50_000, 50_000, device="meta")
    assert layer.weight.is_meta
    assert layer(torch.empty(2, 50_000, device="meta")).shape == (2, 50_000)


def test_gradcheck():
    layer = Linear(4, 3, dtype=torch.float64)
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    w = layer.weight.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda inp, w: functional_call(layer, {"weight": w}, (inp,)), (x, w))


def test_input_not_modified():
    x = torch.randn(3, 4)
    before = x.clone()
    Linear(4, 2)(x)
    torch.testing.assert_close(x, before, rtol=0, atol=0)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((0, 3), ValueError, "in_features must be positive, got 0"),
        ((3, -1), ValueError, "out_features must be positive, got -1"),
        ((3.0, 3), TypeError, "in_features must be an int, got float"),
        ((True, 3), TypeError, "in_features must be an int, got bool"),
    ],
)
def test_bad_constructor_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        Linear(*args)


def test_dtype_mismatch_is_left_to_autocast():
    layer = Linear(4, 3)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    expected = F.linear(x, layer.weight.to(torch.bfloat16))
    torch.testing.assert_close(out, expected)


# Edges that a mutation run found unpinned.
def test_one_by_one_layer_is_valid():
    layer = Linear(1, 1)
    x = torch.randn(3, 1)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, float("inf"), float("nan")])
def test_init_std_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match=r"init_std must be a finite number > 0, got"):
        Linear(2, 2, init_std=bad)


@pytest.mark.parametrize("bad", [True, "0.1", torch.tensor(0.1)])
def test_init_std_must_be_a_number(bad):
    with pytest.raises(TypeError, match="init_std must be a number, got"):
        Linear(2, 2, init_std=bad)


# The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import hook with beartype)
# a wrong-shaped tensor is refused by the annotation itself.
def test_a_tensor_without_the_feature_axis_is_refused_by_the_annotation(shape_checks):
    layer = Linear(4, 3)
    shape_checks(tlm_linear.linear, lambda: layer(torch.tensor(1.0)))  # "... d_in" needs one axis at least
