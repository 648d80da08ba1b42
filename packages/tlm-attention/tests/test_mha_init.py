"""The fused q/k/v projection's initialisation statistics (issue 9, item 6).

Each of q, k and v is a (d_model, d_model) matrix, so the course's N(0, 2 / (d_in + d_out))
truncated at ±3σ gives σ² = 1 / d_model whether the three are stored apart or stacked. The
expected std of the truncated normal is a closed form.
"""

import math

import pytest
import torch

from tlm_attention import CausalMultiHeadSelfAttention


def _truncated_normal_std(sigma):
    phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
    return sigma * math.sqrt(1 - 6 * phi3 / math.erf(3 / math.sqrt(2)))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("d_model", [128, 384])
def test_q_k_v_and_output_initialisation_statistics(fused, d_model):
    attn = CausalMultiHeadSelfAttention(d_model, 4, fused=fused)
    sigma = math.sqrt(1.0 / d_model)
    sd = attn.state_dict()
    for name in ("q_proj", "k_proj", "v_proj", "output_proj"):
        w = sd[f"{name}.weight"]
        assert w.shape == (d_model, d_model)
        assert w.abs().max().item() <= 3 * sigma * (1 + 1e-6), name
        assert w.std().item() == pytest.approx(_truncated_normal_std(sigma), rel=0.03), name
        assert w.mean().item() == pytest.approx(0.0, abs=0.03 * sigma), name
    flat = torch.stack([sd[f"{n}_proj.weight"].flatten() for n in "qkv"])
    off_diagonal = torch.corrcoef(flat)[~torch.eye(3, dtype=torch.bool)]
    assert off_diagonal.abs().max() < 0.03  # drawn independently


def test_fused_module_reset_parameters_redraws_with_the_same_statistics():
    attn = CausalMultiHeadSelfAttention(256, 4, fused=True)
    before = attn.state_dict()["q_proj.weight"].clone()
    for module in attn.modules():
        if module is not attn and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    after = attn.state_dict()["q_proj.weight"]
    assert not torch.equal(before, after)
    assert after.std().item() == pytest.approx(_truncated_normal_std(math.sqrt(1 / 256)), rel=0.03)
