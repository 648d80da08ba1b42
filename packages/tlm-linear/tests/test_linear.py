import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import tlm_linear.linear
from tlm_linear import Linear, PackedWeights


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


# The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import hook with beartype)
# a wrong-shaped tensor is refused by the annotation itself.
def test_a_tensor_without_the_feature_axis_is_refused_by_the_annotation(shape_checks):
    layer = Linear(4, 3)
    shape_checks(tlm_linear.linear, lambda: layer(torch.tensor(1.0)))  # "... d_in" needs one axis at least


_MKL = tlm_linear.linear._MKL_LINEAR is not None


@pytest.mark.skipif(not _MKL, reason="this torch has no MKL packed GEMM: PackedWeights packs nothing")
def test_packed_weights_compute_the_matmul_for_their_rows_and_step_aside_otherwise(monkeypatch):
    # Against a float64 einsum (independent of either GEMM); the plain path is the one torch.matmul takes.
    model = torch.nn.Sequential(Linear(64, 96), Linear(96, 40))
    packs = PackedWeights(model, rows=8)
    assert len(packs) == 2
    calls = []
    real = tlm_linear.linear._MKL_LINEAR
    monkeypatch.setattr(tlm_linear.linear, "_MKL_LINEAR", lambda *a: calls.append(a[0].shape) or real(*a))

    def expected(x):
        for layer in model:
            x = torch.einsum("...i,oi->...o", x.double(), layer.weight.double())
        return x

    x = torch.randn(8, 1, 64)
    with torch.no_grad():
        with packs.active():
            out = model(x)
            other_rows = model(torch.randn(3, 64))  # another row count: plain matmul
        assert calls == [(8, 1, 64), (8, 1, 96)] and other_rows.shape == (3, 40)
        # float32 GEMMs over 96 terms of products of N(0,1)-scale inputs: a few ulps of the result's magnitude.
        torch.testing.assert_close(out.double(), expected(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(model(x), torch.matmul(torch.matmul(x, model[0].weight.t()), model[1].weight.t()))
        model[0].weight.mul_(2.0)  # a weight written after packing: its stale copy is never used
        calls.clear()
        with packs.active():
            torch.testing.assert_close(model(x).double(), expected(x), rtol=1e-5, atol=1e-5)
    assert calls == [(8, 1, 96)]
    calls.clear()
    with packs.active():  # gradients on: the plain path, which autograd follows
        model(x).sum().backward()
    assert calls == [] and model[1].weight.grad is not None
