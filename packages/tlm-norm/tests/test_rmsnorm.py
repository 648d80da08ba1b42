import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import tlm_norm.rmsnorm
from tlm_norm import RMSNorm


def random_norm(d: int, device=None, dtype=None) -> RMSNorm:
    norm = RMSNorm(d, device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d, device=device, dtype=dtype) + 0.5)
    return norm


@pytest.mark.parametrize("lead", [(), (3,), (2, 5), (2, 3, 4)])
def test_matches_f_rms_norm(lead, device):
    norm = random_norm(16, device=device)
    x = torch.randn(*lead, 16, device=device)
    expected = F.rms_norm(x, (16,), norm.weight, eps=1e-5)
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)


def test_float64_rederivation():
    norm = random_norm(32, dtype=torch.float64)
    x = torch.randn(4, 32, dtype=torch.float64) * 3
    rms = torch.sqrt((x**2).sum(-1, keepdim=True) / 32 + 1e-5)
    out = norm(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, x / rms * norm.weight, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_reduces_in_float32(dtype, device):
    norm = RMSNorm(64, device=device)
    # 300² overflows float16 (max 65504): a float16 reduction would return zeros or NaN.
    x = (torch.randn(8, 64, device=device) * 300).to(dtype)
    out = norm(x)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    expected = F.rms_norm(x.float(), (64,), norm.weight, eps=1e-5).to(dtype)
    torch.testing.assert_close(out, expected)  # assert_close's per-dtype defaults: one rounding step


def test_half_precision_parameters(device):
    norm = RMSNorm(8, device=device, dtype=torch.bfloat16)
    x = torch.randn(3, 8, device=device, dtype=torch.bfloat16)
    assert norm(x).dtype == torch.bfloat16


def test_init_and_state():
    norm = RMSNorm(10, eps=1e-6)
    torch.testing.assert_close(norm.weight, torch.ones(10), rtol=0, atol=0)
    assert set(norm.state_dict()) == {"weight"}
    assert norm.eps == 1e-6


def test_gradcheck():
    norm = random_norm(6, dtype=torch.float64)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = norm.weight.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, w: functional_call(norm, {"weight": w}, (x,)), (x, w))


def test_input_not_modified():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    before = x.clone()
    RMSNorm(8)(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(d_model=0), ValueError, "d_model must be positive, got 0"),
        (dict(d_model=8.0), TypeError, "d_model must be an int, got float"),
        (dict(d_model=8, eps=-1e-5), ValueError, "eps must be a finite number >= 0, got -1e-05"),
        (dict(d_model=8, eps=float("nan")), ValueError, "eps must be a finite number >= 0, got nan"),
        (dict(d_model=8, eps="1e-5"), TypeError, "eps must be a number, got str"),
        (dict(d_model=True), TypeError, "d_model must be an int, got bool"),
        (dict(d_model=-3), ValueError, "d_model must be positive, got -3"),
        (dict(d_model=8, eps=True), TypeError, "eps must be a number, got bool"),
        (dict(d_model=8, eps=float("inf")), ValueError, "eps must be a finite number >= 0, got inf"),
    ],
)
def test_bad_constructor_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        RMSNorm(**kwargs)


@pytest.mark.parametrize(
    "dtype, scale",
    [
        (torch.float32, 1e30),  # x² overflows float32
        (torch.float32, 3e38),  # next to float32's largest value
        (torch.bfloat16, 1e38),  # bfloat16 shares float32's range, so its squares overflow in float32
        (torch.float16, 6e4),
        (torch.float64, 1e300),
        (torch.float32, 1e-30),  # tiny inputs, where eps dominates
    ],
)
def test_finite_and_correct_for_any_finite_input(dtype, scale):
    norm = random_norm(64, dtype=dtype)
    x = (torch.rand(3, 64, dtype=torch.float64) * 2 - 1) * scale
    x[:, 0] = scale  # the row's largest magnitude is the scale itself
    x = x.to(dtype)
    out = norm(x)
    assert torch.isfinite(out).all()
    # float64 reference from the definition, with the rescaling done by hand in exact powers of two.
    xd = x.double()
    shift = torch.floor(torch.log2(xd.abs().amax(-1, keepdim=True)))
    y = xd * torch.exp2(-shift)
    expected = y / torch.sqrt(y.square().mean(-1, keepdim=True) + 1e-5 * torch.exp2(-2 * shift)) * norm.weight.double()
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 1e-2)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_large_inputs_match_f_rms_norm_on_the_rescaled_input():
    # F.rms_norm of x/s (no overflow) equals RMSNorm(x) when eps is scaled by 1/s² too: here eps=0.
    norm = RMSNorm(32, eps=0.0)
    x = torch.randn(4, 32) * 1e25
    expected = F.rms_norm(x / 1e25, (32,), norm.weight, eps=0.0)
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)


# Edges that a mutation run found unpinned: eps at its bounds, one-element rows.
@pytest.mark.parametrize("eps", [0, 0.0, 1e-30, 3])
def test_eps_at_and_near_zero_is_accepted_and_used(eps):
    norm = RMSNorm(6, eps=eps)
    assert norm.eps == float(eps) and isinstance(norm.eps, float)
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(norm.double()(x), F.rms_norm(x, (6,), eps=float(eps)))


def test_one_element_rows_normalise_to_the_sign():
    x = torch.tensor([[3.0], [-0.5]], dtype=torch.float64)
    torch.testing.assert_close(RMSNorm(1, eps=0.0).double()(x), torch.sign(x))


# RMSNorm in bfloat16 and float16: the reduction runs in float32, so the result is the exact value rounded once to the
# low-precision dtype, give or take one rounding step (one ulp).
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


# The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import hook with beartype)
# a wrong-shaped tensor is refused by the annotation itself.
def test_a_tensor_without_the_model_axis_is_refused_by_the_annotation(shape_checks):
    norm = RMSNorm(4)
    shape_checks(tlm_norm.rmsnorm, lambda: norm(torch.tensor(1.0)))  # "... d_model" needs one axis at least


@pytest.mark.parametrize("scale", [1.0, 1e30])  # 1e30: the squares overflow float32 (they are summed in float64)
def test_gradients_match_float64_autograd_of_the_formula(scale):
    norm = random_norm(48)
    x = torch.randn(3, 5, 48)
    x[1, 2] *= scale
    x.requires_grad_()
    grad_out = torch.randn(3, 5, 48)
    norm(x).backward(grad_out)
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    float64_rmsnorm(x64, w64, norm.eps).backward(grad_out.double())
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6 / scale)
    torch.testing.assert_close(norm.weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_come_back_in_their_dtype(dtype):
    norm = random_norm(32, dtype=dtype)
    x = torch.randn(4, 32).to(dtype).requires_grad_()
    grad_out = torch.randn(4, 32).to(dtype)
    norm(x).backward(grad_out)
    assert x.grad.dtype == norm.weight.grad.dtype == dtype
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    float64_rmsnorm(x64, w64, norm.eps).backward(grad_out.double())
    torch.testing.assert_close(x.grad, x64.grad.to(dtype))
    torch.testing.assert_close(norm.weight.grad, w64.grad.to(dtype))


def test_backward_keeps_only_the_input_and_one_value_per_row():
    norm = random_norm(16)
    x = torch.randn(2, 7, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x)
    assert {tuple(t.shape) for t in saved} == {(2, 7, 16), (16,), (2, 7, 1)}  # x, the gain, 1/rms
    assert any(t.data_ptr() == x.data_ptr() for t in saved)  # the input itself, not a copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_no_grad_path_matches_f_rms_norm(dtype):
    # Inference (generate, eval) runs this path: no autograd Function, nothing saved.
    norm = random_norm(16, dtype=dtype)
    x = torch.randn(2, 3, 16, dtype=dtype) * 4
    x[0, 1] = 0.0  # a row of zeros normalises to zeros
    with torch.no_grad():
        out = norm(x)
        expected = F.rms_norm(x, (16,), norm.weight, eps=norm.eps)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[0, 1], torch.zeros(16, dtype=dtype))


@pytest.mark.parametrize(
    ("grad_mode", "x_grad", "weight_grad", "function"),
    [
        (True, True, True, True),
        (True, True, False, True),  # a frozen gain: still the written-out backward for x
        (True, False, True, True),  # the gain alone is trained
        (True, False, False, False),  # nothing to differentiate
        (False, True, True, False),  # torch.no_grad(): inference
    ],
)
def test_the_autograd_function_runs_exactly_when_a_gradient_is_needed(
    grad_mode, x_grad, weight_grad, function, monkeypatch
):
    calls = []
    apply = tlm_norm.rmsnorm._RMSNormFunction.apply
    monkeypatch.setattr(tlm_norm.rmsnorm._RMSNormFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    norm = random_norm(8)
    norm.weight.requires_grad_(weight_grad)
    x = torch.randn(3, 8, requires_grad=x_grad)
    with torch.set_grad_enabled(grad_mode):
        out = norm(x)
    assert bool(calls) is function
    assert out.requires_grad is (grad_mode and (x_grad or weight_grad))
    with torch.no_grad():
        torch.testing.assert_close(out, F.rms_norm(x, (8,), norm.weight, eps=norm.eps), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("which", ["x", "weight"])
def test_one_sided_gradients_match_float64_autograd(which):
    norm = random_norm(12)
    x = torch.randn(5, 12, requires_grad=which == "x")
    norm.weight.requires_grad_(which == "weight")
    grad_out = torch.randn(5, 12)
    norm(x).backward(grad_out)
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    rms = torch.sqrt((x64**2).mean(-1, keepdim=True) + norm.eps)
    (x64 / rms * w64).backward(grad_out.double())
    got, want, other = (x.grad, x64.grad, norm.weight.grad) if which == "x" else (norm.weight.grad, w64.grad, x.grad)
    assert other is None
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_reset_parameters_puts_the_gain_back_to_ones():
    norm = random_norm(6)
    norm.reset_parameters()
    assert torch.equal(norm.weight.detach(), torch.ones(6))


@pytest.mark.parametrize("param_dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0, 6e4])
def test_float16_inference_through_torchs_kernel_is_float32_math_rounded_once(param_dtype, scale, ulp_distance):
    # Issue 42: where float32 accumulation provably suffices (float16 input: every square lies in float32's
    # normal range), inference runs F.rms_norm; the result keeps the one-ulp bound against float64.
    norm = with_random_gain(RMSNorm(256, dtype=param_dtype), 0)
    x = inputs(torch.float16, scale, 0).clamp(-65504, 65504)
    with torch.no_grad():
        out = norm(x)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    expected = float64_rmsnorm(x, norm.weight, norm.eps).to(torch.float16)
    assert ulp_distance(out, expected).max().item() <= 1


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 1e30), (torch.bfloat16, 1e30), (torch.float64, 1e300)])
def test_inference_of_wide_types_stays_finite_where_float32_squares_overflow(dtype, scale):
    # Only float16 may take torch's float32 kernel: the square of 1e30 overflows float32 (F.rms_norm gives 0 there),
    # so a float32, bfloat16 or float64 row under no_grad must still take the float64-summed path.
    norm = RMSNorm(8, dtype=dtype)
    x = torch.full((2, 8), scale, dtype=torch.float64)
    x[1] *= -1
    with torch.no_grad():
        out = norm(x.to(dtype))
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), torch.tensor([[1.0] * 8, [-1.0] * 8], dtype=torch.float64))
