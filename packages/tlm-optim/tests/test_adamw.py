"""AdamW against torch.optim.AdamW and against a float64 re-derivation of the course's algorithm."""

import io
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tlm_optim import AdamW

STEPS = 100
# Two parameter groups with different settings; the first uses the lr 1e-3 and decay 0.01.
GROUPS = [
    {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
    {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
]
SHAPES = [[(16, 8), (8,)], [(4, 3, 5), (1,)]]
# The default (torch's fused kernel, re-parametrised), the multi-tensor path, the one-tensor path.
PATHS = [{}, {"fused": True}, {"fused": False}, {"foreach": True}, {"foreach": False}]


def _initial(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for shapes in SHAPES]


def _gradients(dtype=torch.float32):
    """A fixed sequence of gradients (not a function of the parameters, so every optimizer sees the same)."""
    gen = torch.Generator().manual_seed(2)
    return [
        [[(torch.randn(s, generator=gen) * (1 + t % 7)).to(dtype) for s in shapes] for shapes in SHAPES]
        for t in range(STEPS)
    ]


def _run(make_optimizer, dtype=torch.float32, steps=STEPS):
    params = [[p.clone().requires_grad_() for p in group] for group in _initial(dtype)]
    opt = make_optimizer([{"params": ps, **settings} for ps, settings in zip(params, GROUPS, strict=True)])
    for grads in _gradients(dtype)[:steps]:
        for ps, gs in zip(params, grads, strict=True):
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.clone()
        opt.step()
    return [p.detach() for ps in params for p in ps]


def _reference(decay_first=False):
    """The course's Algorithm 2 in float64, written out per element; also returns Σ_t αλ|α_t u_t|."""
    params = [p.double() for group in _initial() for p in group]
    settings = [GROUPS[i] for i, group in enumerate(SHAPES) for _ in group]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    order_gap = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(_gradients(), start=1):
        flat = [g.double() for group in grads for g in group]
        for i, (g, s) in enumerate(zip(flat, settings, strict=True)):
            (b1, b2), lr, lam, eps = s["betas"], s["lr"], s["weight_decay"], s["eps"]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            alpha_t = lr * (1 - b2**t) ** 0.5 / (1 - b1**t)
            update = alpha_t * m[i] / (v[i].sqrt() + eps)
            if decay_first:
                params[i] = params[i] - lr * lam * params[i]
                params[i] = params[i] - update
            else:
                params[i] = params[i] - update
                params[i] = params[i] - lr * lam * params[i]
            order_gap[i] += lr * lam * update.abs()
    return params, order_gap


def test_matches_torch_adamw(record_error):
    ours = _run(AdamW)
    theirs = _run(lambda groups: torch.optim.AdamW(groups, foreach=True))
    for a, b in zip(ours, theirs, strict=True):
        record_error("AdamW vs torch.optim.AdamW, 100 steps", a, b)
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5)


def test_matches_float64_rederivation(record_error):
    expected, _ = _reference()
    # Run in float64, the algorithm itself is checked to far below the 1e-6, on every path.
    for path in PATHS:
        ours = _run(lambda groups, kw=path: AdamW(groups, **kw), dtype=torch.float64)
        for a, b in zip(ours, expected, strict=True):
            record_error(f"AdamW {path or 'default'} float64 vs float64 course algorithm, 100 steps", a, b)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # In float32 each of the 100 steps rounds θ once (half an ulp, ≤ 2⁻²⁴|θ|), which bounds the drift.
    for path in PATHS:
        for a, b in zip(_run(lambda groups, kw=path: AdamW(groups, **kw)), expected, strict=True):
            record_error("AdamW float32 vs float64 course algorithm, 100 steps", a, b)
            bound = STEPS * 2.0**-24 * b.abs().max().item()
            torch.testing.assert_close(a.double(), b, rtol=0, atol=bound)


def test_decay_order_bound():
    """We decay after the Adam update (the course); torch before. Both orders stay within Σ αλ|α_t u_t|."""
    after, gap = _reference(decay_first=False)
    before, _ = _reference(decay_first=True)
    theirs = _run(lambda groups: torch.optim.AdamW(groups, foreach=True))
    ours = _run(AdamW)
    for a, b, bound, t, o in zip(after, before, gap, theirs, ours, strict=True):
        assert bound.max() > 0
        # The two float64 orders differ by at most the accumulated αλ·|update| (plus rounding).
        assert ((a - b).abs() <= bound * 1.01 + 1e-15).all()
        # Ours sits on the "after" trajectory: closer to it than the order gap.
        assert ((o.double() - a).abs() <= STEPS * 2.0**-24 * a.abs().max()).all()
        # torch sits within the order gap of ours, up to float32 rounding and its ε placement.
        assert ((t.double() - o.double()).abs() <= bound * 1.01 + 5e-6).all()


def test_foreach_and_single_tensor_paths_agree_exactly():
    a = _run(lambda groups: AdamW(groups, foreach=True))
    b = _run(lambda groups: AdamW(groups, foreach=False))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_the_fused_paths_device_step_counter_equals_a_fresh_step_each_time():
    # Issue 42: the fused kernel's step tensor is a counter on the device advanced by add_(1), not a host copy
    # per step; a step that makes its tensor afresh from the host count must give the same bits.
    class Fresh(AdamW):
        def _device_step(self, device, step):
            return torch.tensor(float(step), device=device)

    for a, b in zip(_run(lambda groups: AdamW(groups, fused=True)), _run(lambda groups: Fresh(groups, fused=True)),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)


def test_the_device_step_is_cached_by_the_host_step_and_advanced_in_place_below_2_to_the_24():
    opt = AdamW([torch.zeros(2, requires_grad=True)], fused=True)
    cpu = torch.device("cpu")
    counter = opt._device_step(cpu, 5)
    assert counter.dtype == torch.float32 and counter.item() == 5.0
    counter.fill_(7.0)  # the cache is keyed by the host's step, never by reading the tensor back (a sync)
    assert opt._device_step(cpu, 5) is counter and counter.item() == 7.0
    # The next step: add_(1) in place, decided by the host's step too (the tensor, left at 7, is not read).
    assert opt._device_step(cpu, 6) is counter and counter.item() == 8.0
    fresh = opt._device_step(cpu, 8)  # a step skipped: made afresh from the host count
    assert fresh is not counter and fresh.item() == 8.0
    below = opt._device_step(cpu, 2**24 - 2)
    assert opt._device_step(cpu, 2**24 - 1) is below  # still counted in place
    last = opt._device_step(cpu, 2**24)  # float32 counts exactly only to 2**24: from there on, a fill per step
    assert last is not below and last.item() == 2.0**24


def test_the_fused_update_makes_its_step_counter_when_given_none():
    # _fused_update's counter is optional ("made here when None"): without one it steps as with a fresh counter.
    from tlm_optim.adamw import _Batch, _fused_update

    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    m, v = torch.randn(6, generator=gen), torch.rand(6, generator=gen)
    copies = [[t.clone() for t in (p, g, m, v)] for _ in range(2)]
    _fused_update(_Batch(*([t] for t in copies[0])), 3, GROUPS[1])
    _fused_update(_Batch(*([t] for t in copies[1])), 3, GROUPS[1], None, torch.full((), 3.0))
    assert all(torch.equal(a, b) for a, b in zip(*copies, strict=True)) and not torch.equal(copies[0][0], p)


def test_a_copied_or_unpickled_optimizer_steps_as_the_original():
    # torch's Optimizer pickles (torch.save, copy.deepcopy) only its defaults, state and groups: the copy makes its
    # own device-step cache and steps as the original does, bit for bit (torch.optim.AdamW's copies do the same).
    import copy

    params = [p.clone().requires_grad_() for p in _initial()[0]]
    opt = AdamW([{"params": params, **GROUPS[0]}], fused=True)
    grads = _gradients()[:3]
    for step in grads[:2]:
        for p, grad in zip(params, step[0], strict=True):
            p.grad = grad.clone()
        opt.step()
    twin = copy.deepcopy(opt)
    twin_params = twin.param_groups[0]["params"]
    for ps, o in ((params, opt), (twin_params, twin)):
        for p, grad in zip(ps, grads[2][0], strict=True):
            p.grad = grad.clone()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params, strict=True))


def test_state_dict_round_trip_resumes_bit_exactly():
    full = _run(AdamW)
    params = [[p.clone().requires_grad_() for p in group] for group in _initial()]
    opt = AdamW([{"params": ps, **s} for ps, s in zip(params, GROUPS, strict=True)])
    grads_all = _gradients()
    for t, grads in enumerate(grads_all):
        if t == 37:  # save, then rebuild everything from the saved bytes
            buffer = io.BytesIO()
            torch.save({"params": [[p.detach() for p in ps] for ps in params], "opt": opt.state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=True)
            params = [[p.clone().requires_grad_() for p in ps] for ps in saved["params"]]
            opt = AdamW([{"params": ps, **s} for ps, s in zip(params, GROUPS, strict=True)])
            opt.load_state_dict(saved["opt"])
        for ps, gs in zip(params, grads, strict=True):
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.clone()
        opt.step()
    for a, b in zip([p.detach() for ps in params for p in ps], full, strict=True):
        assert torch.equal(a, b)


def test_none_gradients_are_skipped_and_inputs_untouched():
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    b_before = b.detach().clone()
    a.grad = torch.randn(3)
    grad_before = a.grad.clone()
    opt = AdamW([a, b])
    opt.step()
    assert torch.equal(b.detach(), b_before) and b not in opt.state
    assert torch.equal(a.grad, grad_before)


def test_complex_parameters_match_torch():
    z0 = torch.randn(5, dtype=torch.complex64)
    za, zb = z0.clone().requires_grad_(), z0.clone().requires_grad_()
    oa, ob = AdamW([za]), torch.optim.AdamW([zb])
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        g = torch.randn(5, dtype=torch.complex64, generator=gen)
        za.grad, zb.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(za.detach(), zb.detach(), rtol=0, atol=5e-5)


def test_sparse_gradient_refused():
    p = torch.zeros(4, 2, requires_grad=True)
    p.grad = torch.zeros(4, 2).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        AdamW([p]).step()


def test_closure_is_called_and_its_loss_returned():
    p = torch.ones(2, requires_grad=True)
    opt = AdamW([p])

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 2.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": -1.0}, ValueError, "lr"),
        ({"lr": float("inf")}, ValueError, "lr must be a finite number >= 0, got inf"),
        ({"lr": "0.1"}, TypeError, "lr"),
        ({"lr": True}, TypeError, "lr"),
        ({"betas": (1.0, 0.9)}, ValueError, r"betas\[0\]"),
        ({"betas": (0.9, -0.1)}, ValueError, r"betas\[1\]"),
        ({"betas": 0.9}, TypeError, "betas"),
        ({"eps": -1e-8}, ValueError, "eps"),
        ({"weight_decay": float("nan")}, ValueError, "weight_decay"),
        ({"foreach": "yes"}, TypeError, "foreach"),
        ({"fused": 1}, TypeError, "fused"),
        ({"fused": True, "foreach": True}, ValueError, "foreach"),
    ],
)
def test_bad_hyperparameters(kwargs, error, match):
    with pytest.raises(error, match=match):
        AdamW([torch.zeros(2, requires_grad=True)], **kwargs)


def test_bad_group_setting_refused():
    opt = AdamW([torch.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)], "lr": -1.0})


def test_fused_refuses_what_its_kernel_cannot_do_and_default_falls_back():
    p = torch.ones(3, requires_grad=True)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="lr·weight_decay"):
        AdamW([p], lr=1.0, weight_decay=1.0, fused=True).step()
    AdamW([p], lr=1.0, weight_decay=1.0).step()  # the course's update: (θ − α_t u)(1 − αλ) = 0
    assert torch.equal(p.detach(), torch.zeros(3))


def test_bfloat16_parameters_on_every_path():
    for path in PATHS:
        ours = _run(lambda groups, kw=path: AdamW(groups, **kw), dtype=torch.bfloat16, steps=10)
        ref = _run(lambda groups, kw=path: AdamW(groups, **kw), dtype=torch.float64, steps=10)
        for a, b in zip(ours, ref, strict=True):
            assert a.dtype == torch.bfloat16
            # bfloat16 keeps 8 bits: each of the 10 steps rounds θ by at most 2⁻⁹|θ|.
            torch.testing.assert_close(a.double(), b, rtol=0, atol=10 * 2.0**-9 * b.abs().max().item())


# Property-based (hypothesis; the profile in the root conftest.py decides how many examples run).
@given(st.floats(1e-5, 1e-1), st.floats(0.0, 0.5), st.floats(0.5, 0.99), st.floats(0.9, 0.9999), st.integers(1, 8))
def test_first_step_moves_each_coordinate_by_lr_times_sign(lr, decay, beta1, beta2, seed):
    # At t = 1: m = (1-β₁)g, v = (1-β₂)g², α₁ = α√(1-β₂)/(1-β₁), so the Adam step is α·g/(|g| + ε/√(1-β₂)).
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(6, generator=gen, dtype=torch.float64)
    grad = torch.randn(6, generator=gen, dtype=torch.float64)
    p = theta.clone().requires_grad_()
    p.grad = grad.clone()
    AdamW([p], lr=lr, betas=(beta1, beta2), eps=1e-12, weight_decay=decay).step()
    expected = (theta - lr * grad / (grad.abs() + 1e-12 / math.sqrt(1 - beta2))) * (1 - lr * decay)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("path", PATHS)
def test_found_inf_skips_the_update_on_the_device_and_zero_changes_nothing(path):
    # found_inf=1: parameters and moments bit-for-bit as before (torch's fused kernel honours the flag itself; the
    # other paths put the old values back); found_inf=0: the very update a step without the flag makes.
    def build():
        params = [p.clone().requires_grad_() for p in _initial()[0]]
        for p, g in zip(params, _gradients()[0][0], strict=True):
            p.grad = g.clone()
        return params, AdamW([{"params": params, **GROUPS[1]}], **path)

    params, opt = build()
    opt.step()  # moments that are not zero, so that a skipped update is visible in them too
    before = [
        t.clone()
        for t in (*params, *(s for p in params for s in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])))
    ]
    opt.step(found_inf=torch.ones(()))
    after = [*params, *(s for p in params for s in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]))]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    flagged, plain = build(), build()
    flagged[1].step(found_inf=torch.zeros(()))
    plain[1].step()
    assert all(torch.equal(a, b) for a, b in zip(flagged[0], plain[0], strict=True))
