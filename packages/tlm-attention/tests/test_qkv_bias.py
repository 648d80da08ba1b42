"""``qkv_bias``: Qwen2's biases on q, k and v, against F.linear with a bias and torch's SDPA."""

import pickle

import pytest
import torch
import torch.nn.functional as F

from tlm_attention import CausalMultiHeadSelfAttention, KVCache
from tlm_rope import RotaryPositionalEmbedding


def reference(weights, x, heads, kv_heads, rope):
    def split(t, n):
        return t.unflatten(-1, (n, -1)).transpose(-2, -3)

    q, k, v = (F.linear(x, weights[f"{p}_proj.weight"], weights[f"{p}_proj.bias"]) for p in "qkv")
    q, k, v = split(q, heads), split(k, kv_heads), split(v, kv_heads)
    q, k = rope(q), rope(k)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.linear(out.transpose(-2, -3).flatten(-2), weights["output_proj.weight"])


@pytest.mark.parametrize("fused", [True, False])
def test_biases_are_added_to_q_k_and_v_and_saved_under_their_projections(fused):
    torch.manual_seed(0)
    rope = RotaryPositionalEmbedding(10_000.0, 8, 16)
    attn = CausalMultiHeadSelfAttention(32, 4, rope, fused=fused, num_kv_heads=2, qkv_bias=True)
    weights = attn.state_dict()
    assert {k for k in weights if k.endswith("bias")} == {"q_proj.bias", "k_proj.bias", "v_proj.bias"}
    assert weights["q_proj.bias"].shape == (32,) and weights["k_proj.bias"].shape == (16,)
    assert all(torch.equal(weights[f"{p}_proj.bias"], torch.zeros_like(weights[f"{p}_proj.bias"])) for p in "qkv")
    weights = {k: 0.3 * torch.randn_like(v) for k, v in weights.items()}
    attn.load_state_dict(weights)
    x = torch.randn(2, 11, 32)
    torch.testing.assert_close(attn(x), reference(weights, x, 4, 2, rope), rtol=1e-5, atol=1e-5)
    # The cached path adds them too: one token at a time equals the whole sequence.
    cache = KVCache(2, 2, 16, 8)
    steps = torch.cat([attn(x[:, i : i + 1], kv_cache=cache) for i in range(11)], dim=1)
    torch.testing.assert_close(steps, attn(x), rtol=1e-5, atol=1e-5)
    # reset_parameters zeroes them; the module still pickles whole with its state-dict hooks.
    attn.reset_parameters()
    assert not attn.qkv_bias.any()
    assert pickle.loads(pickle.dumps(attn)).state_dict().keys() == attn.state_dict().keys()


def test_fused_and_unfused_load_each_others_biases():
    torch.manual_seed(0)
    fused = CausalMultiHeadSelfAttention(32, 4, fused=True, qkv_bias=True)
    with torch.no_grad():
        fused.qkv_bias.normal_()
    plain = CausalMultiHeadSelfAttention(32, 4, fused=False, qkv_bias=True)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(5, 32)
    torch.testing.assert_close(plain(x), fused(x), rtol=1e-5, atol=1e-6)


def test_the_default_has_no_bias_and_refuses_bias_keys():
    attn = CausalMultiHeadSelfAttention(32, 4)
    assert attn.qkv_bias is None and not any("bias" in k for k in attn.state_dict())
    biased = CausalMultiHeadSelfAttention(32, 4, qkv_bias=True).state_dict()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        attn.load_state_dict(biased)
    with pytest.raises(TypeError, match="qkv_bias must be a bool"):
        CausalMultiHeadSelfAttention(32, 4, qkv_bias=1)
