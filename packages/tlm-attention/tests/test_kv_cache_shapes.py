"""KVCache shape checks and attention with a cache (issue 9, item 6): mismatched keys and values are
refused before anything is stored, and cached attention equals torch's SDPA over the whole sequence."""

import math

import pytest
import torch
import torch.nn.functional as F

from tlm_attention import BACKENDS, CausalMultiHeadSelfAttention, KVCache, causal_attention
from tlm_rope import RotaryPositionalEmbedding


@pytest.mark.parametrize(
    "keys_shape, values_shape",
    [
        ((1, 2, 1, 4), (1, 2, 2, 4)),  # different number of new tokens
        ((1, 2, 1, 4), (1, 2, 1, 5)),  # values with another d_head
        ((1, 2, 1, 4), (2, 2, 1, 4)),  # values with another batch
        ((1, 2, 1, 4), (1, 3, 1, 4)),  # values with other heads
        ((2, 2, 1, 4), (2, 2, 1, 4)),  # both with the wrong batch
        ((1, 2, 1, 5), (1, 2, 1, 5)),  # both with the wrong d_head
        ((1, 2, 1), (1, 2, 1)),  # no d_head axis at all
    ],
)
def test_mismatched_keys_and_values_are_refused_and_nothing_is_stored(keys_shape, values_shape):
    cache = KVCache(1, 2, capacity=6, d_head=4)
    cache.update(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
    keys_before, values_before = cache.keys.clone(), cache.values.clone()
    with pytest.raises(ValueError, match=r"keys and values must have shape \(batch, heads, new, d_head\)"):
        cache.update(torch.randn(keys_shape), torch.randn(values_shape))
    assert cache.length == 2
    assert torch.equal(cache.keys, keys_before) and torch.equal(cache.values, values_before)


def test_update_fills_exactly_to_capacity_and_the_returned_views_alias_the_buffers():
    cache = KVCache(1, 1, capacity=3, d_head=2, dtype=torch.float64)
    k, v = torch.randn(1, 1, 3, 2, dtype=torch.float64), torch.randn(1, 1, 3, 2, dtype=torch.float64)
    got_k, got_v = cache.update(k, v)
    assert cache.length == 3 and torch.equal(got_k, k) and torch.equal(got_v, v)
    assert got_k.dtype == torch.float64 and cache.keys.dtype == torch.float64
    with pytest.raises(ValueError, match="holds 3 tokens; 3 stored \\+ 1 new is too many"):
        cache.update(k[:, :, :1], v[:, :, :1])
    assert cache.length == 3


def test_reset_lets_the_cache_be_refilled_from_the_start():
    cache = KVCache(1, 1, capacity=2, d_head=2)
    cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
    cache.reset()
    k, v = cache.update(torch.full((1, 1, 1, 2), 5.0), torch.full((1, 1, 1, 2), 7.0))
    assert k.shape == (1, 1, 1, 2) and (k == 5).all() and (v == 7).all()


@pytest.mark.parametrize("bad", [True, 1.0, -1, "2"])
@pytest.mark.parametrize("name", ["batch_size", "num_heads", "capacity", "d_head"])
def test_constructor_arguments_must_be_positive_ints(name, bad):
    kwargs = dict(batch_size=1, num_heads=1, capacity=1, d_head=2)
    kwargs[name] = bad
    with pytest.raises(ValueError, match=f"{name} must be a positive int, got {bad!r}"):
        KVCache(**kwargs)


def _manual_mha(attn, x, theta):
    """The attention module re-derived in float64 from its state dict with torch built-ins."""
    sd = {k: v.double() for k, v in attn.state_dict().items()}
    heads, seq = attn.num_heads, x.shape[-2]
    q, k, v = (F.linear(x.double(), sd[f"{n}_proj.weight"]).unflatten(-1, (heads, -1)).transpose(1, 2) for n in "qkv")
    d = q.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    rot = torch.polar(torch.ones_like(angles), angles)

    def rope(t):
        return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], d // 2, 2)) * rot).flatten(-2)

    out = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
    return F.linear(out.transpose(1, 2).flatten(-2), sd["output_proj.weight"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunks", [(1, 1, 1, 1, 1), (1, 4), (3, 2), (2, 1, 2)])
def test_cached_attention_in_chunks_matches_the_float64_whole_sequence(backend, chunks):
    rope = RotaryPositionalEmbedding(10_000.0, 8, 16)
    attn = CausalMultiHeadSelfAttention(32, 4, rope=rope, attention_backend=backend)
    x = torch.randn(2, sum(chunks), 32)
    expected = _manual_mha(attn, x, 10_000.0)
    cache = KVCache(2, 4, capacity=16, d_head=8)
    outs, start = [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(attn(x[:, start : start + n], kv_cache=cache))
            start += n
    assert cache.length == sum(chunks)
    torch.testing.assert_close(torch.cat(outs, dim=1).double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_q, num_k", [(1, 1), (1, 6), (3, 7), (4, 4)])
def test_causal_attention_is_bottom_right_aligned(backend, num_q, num_k):
    q = torch.randn(2, 3, num_q, 8, dtype=torch.float64)
    k, v = torch.randn(2, 3, num_k, 8, dtype=torch.float64), torch.randn(2, 3, num_k, 8, dtype=torch.float64)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    visible = torch.arange(num_k) <= torch.arange(num_q).unsqueeze(-1) + (num_k - num_q)
    expected = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v
    torch.testing.assert_close(causal_attention(q, k, v, backend), expected, rtol=1e-10, atol=1e-10)


def test_kv_cache_needs_a_batch_axis():
    attn = CausalMultiHeadSelfAttention(8, 2)
    with pytest.raises(ValueError, match=r"with a kv_cache, x must have shape \(batch, seq, d_model\)"):
        attn(torch.randn(3, 8), kv_cache=KVCache(1, 2, 4, 4))
