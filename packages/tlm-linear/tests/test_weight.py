"""The course's initialisation (CS336 §1.4.1), held once by tlm_linear._weight under Linear and Embedding:
N(0, σ²) truncated at ±3σ, with σ² = 2 / (d_in + d_out) for a Linear and σ = 1 for an Embedding unless
``init_std`` says otherwise. The expected std of the truncated normal is its closed form."""

import math

import pytest
import torch

from tlm_linear import Embedding, Linear
from tlm_linear._weight import TruncatedNormalWeight


def truncated_normal_std(sigma: float, cut: float = 3.0) -> float:
    """Closed-form std of N(0, sigma²) truncated to [-cut·sigma, cut·sigma]."""
    pdf = math.exp(-cut * cut / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(cut / math.sqrt(2))
    return sigma * math.sqrt(1 - 2 * cut * pdf / mass)


@pytest.mark.parametrize(
    ("make", "sigma"),
    [
        (lambda: Linear(1024, 768), math.sqrt(2 / (1024 + 768))),  # the course's rule for a Linear
        (lambda: Linear(512, 1536, init_std=0.03), 0.03),  # a stacked q/k/v keeps one projection's σ
        (lambda: Embedding(4096, 256), 1.0),  # the course's rule for an Embedding
        (lambda: Embedding(4096, 256, init_std=0.0625), 0.0625),  # 1/sqrt(256): a tied table's
    ],
    ids=["linear", "linear-init_std", "embedding", "embedding-init_std"],
)
def test_the_weight_is_normal_truncated_at_three_sigma(make, sigma):
    torch.manual_seed(0)
    module = make()
    assert isinstance(module, TruncatedNormalWeight) and module.init_std == pytest.approx(sigma, rel=1e-12)
    w = module.weight.detach().double()
    assert w.abs().max().item() <= 3 * sigma
    assert abs(w.mean().item()) < 0.01 * sigma
    assert w.std().item() == pytest.approx(truncated_normal_std(sigma), rel=0.02)


def test_reset_parameters_draws_again_by_the_same_rule():
    torch.manual_seed(0)
    layer = Linear(512, 512)
    with torch.no_grad():
        layer.weight.fill_(5.0)
    layer.reset_parameters()
    w = layer.weight.detach().double()
    assert w.abs().max().item() <= 3 * layer.init_std
    assert w.std().item() == pytest.approx(truncated_normal_std(layer.init_std), rel=0.02)


@pytest.mark.parametrize("cls", [Linear, Embedding])
@pytest.mark.parametrize("bad", [0, 0.0, -0.5, float("inf"), float("nan")])
def test_init_std_must_be_positive_and_finite(cls, bad):
    with pytest.raises(ValueError, match=r"init_std must be a finite number > 0, got"):
        cls(2, 2, init_std=bad)


@pytest.mark.parametrize("cls", [Linear, Embedding])
@pytest.mark.parametrize("bad", [True, "0.1", torch.tensor(0.1)])
def test_init_std_must_be_a_number(cls, bad):
    with pytest.raises(TypeError, match="init_std must be a number, got"):
        cls(2, 2, init_std=bad)


@pytest.mark.parametrize("cls", [Linear, Embedding])
def test_the_weight_takes_the_device_and_dtype_asked_for(cls):
    module = cls(4, 6, device="meta", dtype=torch.float64)
    assert module.weight.device.type == "meta" and module.weight.dtype == torch.float64
