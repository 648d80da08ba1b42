import dataclasses

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM, save_hf
from tlm_model.interop import from_hf_llama_state_dict, hf_llama_config_kwargs, to_hf_llama_state_dict

CFG = ModelConfig(vocab_size=31, context_length=8, d_model=24, num_layers=2, num_heads=3, d_ff=40)


def test_round_trip_is_the_identity():
    sd = TransformerLM(CFG).state_dict()
    back = from_hf_llama_state_dict(to_hf_llama_state_dict(sd, CFG), CFG)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_rows_move_from_interleaved_to_rotate_half_pairs():
    sd = TransformerLM(CFG).state_dict()
    hf = to_hf_llama_state_dict(sd, CFG)
    q, q_hf = sd["layers.0.attn.q_proj.weight"], hf["model.layers.0.self_attn.q_proj.weight"]
    d_head = CFG.d_head
    for head in range(CFG.num_heads):
        for k in range(d_head // 2):
            # HF pairs row k with row k + d/2; they must hold our interleaved pair (2k, 2k + 1).
            assert torch.equal(q_hf[head * d_head + k], q[head * d_head + 2 * k])
            assert torch.equal(q_hf[head * d_head + d_head // 2 + k], q[head * d_head + 2 * k + 1])
    assert torch.equal(hf["model.layers.1.self_attn.v_proj.weight"], sd["layers.1.attn.v_proj.weight"])


def test_config_kwargs():
    kwargs = hf_llama_config_kwargs(CFG)
    assert kwargs["hidden_size"] == 24 and kwargs["num_key_value_heads"] == 3
    assert kwargs["rope_parameters"]["rope_theta"] == CFG.rope_theta


def test_an_ablation_is_refused_by_every_export_function_naming_each_field(tmp_path):
    cfg = dataclasses.replace(CFG, norm_placement="post", positions="none", ffn="silu")
    model = TransformerLM(cfg)
    message = (
        r"an HF Llama cannot express ModelConfig.norm_placement='post' \(.*only norm_placement='pre' exports\); "
        r"ModelConfig.positions='none' \(.*\); ModelConfig.ffn='silu' \(.*only ffn='swiglu' exports\)$"
    )
    for export in (
        lambda: hf_llama_config_kwargs(cfg),
        lambda: to_hf_llama_state_dict(model.state_dict(), cfg),
        lambda: save_hf(model, tmp_path / "hf"),
    ):
        with pytest.raises(ValueError, match=message):
            export()
    assert not (tmp_path / "hf").exists()
