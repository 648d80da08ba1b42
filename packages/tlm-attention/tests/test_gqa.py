"""Grouped-/multi-query attention and a free head_dim, against torch built-ins."""

import pytest
import torch
import torch.nn.functional as F

from tlm_attention import BACKENDS, CausalMultiHeadSelfAttention, KVCache, causal_attention
from tlm_rope import RotaryPositionalEmbedding


def repeat_kv_reference(q, k, v, mask=None):
    """Causal SDPA after repeating each kv head over its query group, as HF's repeat_kv does."""
    groups = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(groups, dim=-3) for t in (k, v))
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def gqa_reference(attn, x, rotate=None):
    """MHA from F.linear and F.scaled_dot_product_attention(enable_gqa=True), on the course keys."""
    weights = attn.state_dict()

    def split(t, heads):
        return t.unflatten(-1, (heads, -1)).transpose(-2, -3)

    q = split(F.linear(x, weights["q_proj.weight"]), attn.num_heads)
    k, v = (split(F.linear(x, weights[f"{p}.weight"]), attn.num_kv_heads) for p in ("k_proj", "v_proj"))
    if rotate is not None:
        q, k = rotate(q), rotate(k)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.linear(out.transpose(-2, -3).flatten(-2), weights["output_proj.weight"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2), (8, 1), (6, 3)])
def test_causal_attention_groups_match_repeat_kv(backend, heads, kv_heads, device):
    torch.manual_seed(0)
    q = torch.randn(2, heads, 7, 16, device=device)
    k, v = torch.randn(2, 2, kv_heads, 7, 16, device=device)
    torch.testing.assert_close(causal_attention(q, k, v, backend), repeat_kv_reference(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_attention_groups_with_cache_offset(backend, device):
    torch.manual_seed(1)
    q = torch.randn(2, 4, 3, 8, device=device)
    k, v = torch.randn(2, 2, 2, 10, 8, device=device)
    mask = torch.ones(3, 10, dtype=torch.bool, device=device).tril(7)
    torch.testing.assert_close(
        causal_attention(q, k, v, backend), repeat_kv_reference(q, k, v, mask), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_gradients_match_repeat_kv(backend, device):
    torch.manual_seed(2)
    q = torch.randn(1, 6, 5, 8, device=device, requires_grad=True)
    k = torch.randn(1, 2, 5, 8, device=device, requires_grad=True)
    v = torch.randn(1, 2, 5, 8, device=device, requires_grad=True)
    grads = torch.autograd.grad(causal_attention(q, k, v, backend).square().sum(), (q, k, v))
    expected = torch.autograd.grad(repeat_kv_reference(q, k, v).square().sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_causal_attention_refuses_kv_heads_not_dividing_heads():
    q, k = torch.randn(1, 6, 4, 8), torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="kv_heads"):
        causal_attention(q, k, k, "reference")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 8), (4, 1, 12), (6, 2, 4), (4, 4, 16)])
def test_module_matches_enable_gqa_reference(backend, fused, heads, kv_heads, head_dim, device, rope_reference):
    torch.manual_seed(3)
    rope = RotaryPositionalEmbedding(10_000.0, head_dim, max_seq_len=32, device=device)
    attn = CausalMultiHeadSelfAttention(
        24, heads, rope=rope, device=device, attention_backend=backend, fused=fused,
        num_kv_heads=kv_heads, head_dim=head_dim,
    )  # fmt: skip
    x = torch.randn(2, 7, 24, device=device)
    positions = torch.arange(7, device=device)

    def rotate(t):
        return rope_reference(t, positions, 10_000.0).to(t.dtype)

    torch.testing.assert_close(attn(x), gqa_reference(attn, x, rotate), rtol=1e-5, atol=1e-6)


def test_state_dict_shapes_and_fused_round_trip():
    split = CausalMultiHeadSelfAttention(32, 8, fused=False, num_kv_heads=2, head_dim=6)
    shapes = {k: tuple(v.shape) for k, v in split.state_dict().items()}
    assert shapes == {
        "q_proj.weight": (48, 32), "k_proj.weight": (12, 32), "v_proj.weight": (12, 32), "output_proj.weight": (32, 48)
    }  # fmt: skip
    fused = CausalMultiHeadSelfAttention(32, 8, fused=True, num_kv_heads=2, head_dim=6)
    fused.load_state_dict(split.state_dict())  # the course's split keys load into the fused layout
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(fused(x), split(x), rtol=1e-6, atol=1e-6)
    assert fused.state_dict().keys() == split.state_dict().keys()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_holds_only_kv_heads_and_decodes_like_full_forward(backend):
    torch.manual_seed(4)
    rope = RotaryPositionalEmbedding(10_000.0, 4, max_seq_len=16)
    attn = CausalMultiHeadSelfAttention(32, 8, rope=rope, attention_backend=backend, num_kv_heads=2)
    x = torch.randn(2, 9, 32)
    cache = KVCache(2, 2, 16, 4)
    steps = [attn(x[:, :5], kv_cache=cache)] + [attn(x[:, i : i + 1], kv_cache=cache) for i in range(5, 9)]
    assert cache.keys.shape == (2, 2, 16, 4)
    torch.testing.assert_close(torch.cat(steps, dim=1), attn(x), rtol=1e-5, atol=1e-6)


def test_cache_with_query_heads_is_refused():
    attn = CausalMultiHeadSelfAttention(32, 8, num_kv_heads=2)
    with pytest.raises(ValueError, match="keys and values must have shape"):
        attn(torch.randn(1, 3, 32), kv_cache=KVCache(1, 8, 8, 4))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_kv_heads": 3}, ValueError, "num_kv_heads must divide num_heads"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be positive"),
        ({"num_kv_heads": 2.0}, TypeError, "num_kv_heads must be an int"),
        ({"head_dim": 0}, ValueError, "head_dim must be positive"),
    ],
)
def test_bad_grouping_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        CausalMultiHeadSelfAttention(32, 8, **kwargs)


def test_head_dim_frees_d_model_from_divisibility():
    attn = CausalMultiHeadSelfAttention(30, 4, head_dim=8)
    assert attn(torch.randn(2, 3, 30)).shape == (2, 3, 30)
    with pytest.raises(ValueError, match="or give head_dim"):
        CausalMultiHeadSelfAttention(30, 4)


def test_registered_backend_without_grouped_kv_sees_repeated_heads():
    from tlm_attention import backends, register_attention_backend

    seen = []

    def spy(q, k, v):
        seen.append((q.shape[-3], k.shape[-3]))
        return repeat_kv_reference(q, k, v)

    register_attention_backend("gqa_spy", spy)
    try:
        q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
        causal_attention(q, k, k, "gqa_spy")
    finally:
        del backends._REGISTRY["gqa_spy"]  # other tests list the registered names
    assert seen == [(4, 4)]
