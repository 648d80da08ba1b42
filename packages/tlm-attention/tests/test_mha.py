import pytest
import torch
import torch.nn.functional as F

from tlm_attention import BACKENDS, CausalMultiHeadSelfAttention, KVCache
from tlm_rope import RotaryPositionalEmbedding


def reference_mha(attn, x, heads, rotate=None):
    """Causal MHA from torch built-ins: F.linear projections and fused causal SDPA."""

    def split(t):
        return t.unflatten(-1, (heads, -1)).transpose(-2, -3)

    # The course's state-dict keys, whatever layout (fused or not) the module stores internally.
    weights = attn.state_dict()
    q, k, v = (split(F.linear(x, weights[f"{p}.weight"])) for p in ("q_proj", "k_proj", "v_proj"))
    if rotate is not None:
        q, k = rotate(q), rotate(k)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(out.transpose(-2, -3).flatten(-2), weights["output_proj.weight"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead", [(), (2,), (2, 3)])
def test_matches_builtin_reference_without_rope(lead, backend, device):
    attn = CausalMultiHeadSelfAttention(32, 4, device=device, attention_backend=backend)
    x = torch.randn(*lead, 7, 32, device=device)
    torch.testing.assert_close(attn(x), reference_mha(attn, x, 4), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("offset", [0, 9])
def test_matches_builtin_reference_with_rope(offset, fused, backend, device, rope_reference):
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=32, device=device)
    attn = CausalMultiHeadSelfAttention(32, 4, rope=rope, device=device, attention_backend=backend, fused=fused)
    x = torch.randn(2, 7, 32, device=device)
    positions = torch.arange(offset, offset + 7, device=device)

    def rotate(t):
        return rope_reference(t, positions, 10_000.0).to(t.dtype)

    plain = CausalMultiHeadSelfAttention(32, 4, device=device, fused=False)
    plain.load_state_dict(attn.state_dict())  # the course layout, whatever attn stores internally
    expected = reference_mha(plain, x, 4, rotate)
    got = attn(x, positions) if offset else attn(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_batched_token_positions(rope_reference):
    rope = RotaryPositionalEmbedding(10_000.0, 4, max_seq_len=64)
    attn = CausalMultiHeadSelfAttention(16, 4, rope=rope)
    x = torch.randn(3, 5, 16)
    positions = torch.randint(0, 64, (3, 5))
    rows = [attn(x[b], positions[b]) for b in range(3)]
    torch.testing.assert_close(attn(x, positions), torch.stack(rows), rtol=1e-6, atol=1e-6)


def test_causal_future_tokens_do_not_change_the_past():
    attn = CausalMultiHeadSelfAttention(16, 2, rope=RotaryPositionalEmbedding(10_000.0, 8, 16))
    x = torch.randn(1, 10, 16)
    y = x.clone()
    y[:, 6:] = torch.randn(1, 4, 16)
    torch.testing.assert_close(attn(x)[:, :6], attn(y)[:, :6], rtol=0, atol=0)
    assert not torch.allclose(attn(x)[:, 6:], attn(y)[:, 6:])


def test_state_dict_keys_and_shapes():
    attn = CausalMultiHeadSelfAttention(24, 3, rope=RotaryPositionalEmbedding(10_000.0, 8, 16))
    shapes = {k: tuple(v.shape) for k, v in attn.state_dict().items()}
    assert shapes == {f"{n}.weight": (24, 24) for n in ("q_proj", "k_proj", "v_proj", "output_proj")}


def test_gradcheck():
    attn = CausalMultiHeadSelfAttention(8, 2, rope=RotaryPositionalEmbedding(10_000.0, 4, 8), dtype=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(attn, (x,))


def test_input_not_modified():
    attn = CausalMultiHeadSelfAttention(8, 2, rope=RotaryPositionalEmbedding(10_000.0, 4, 8))
    x, pos = torch.randn(2, 5, 8), torch.arange(5)
    before = x.clone(), pos.clone()
    attn(x, pos)
    assert torch.equal(x, before[0]) and torch.equal(pos, before[1])


def test_bad_arguments():
    with pytest.raises(ValueError, match="d_model must be divisible by num_heads, got d_model=10, num_heads=3"):
        CausalMultiHeadSelfAttention(10, 3)
    with pytest.raises(ValueError, match=r"rope.d_k must equal d_model / num_heads = 4, got rope.d_k=8"):
        CausalMultiHeadSelfAttention(16, 4, rope=RotaryPositionalEmbedding(10_000.0, 8, 16))
    with pytest.raises(TypeError, match="rope must be a RotaryPositionalEmbedding or None, got str"):
        CausalMultiHeadSelfAttention(16, 4, rope="rope")
    with pytest.raises(ValueError, match="num_heads must be positive, got 0"):
        CausalMultiHeadSelfAttention(16, 0)
    attn = CausalMultiHeadSelfAttention(16, 4)
    with pytest.raises(ValueError, match="token_positions was given but this attention module has no rope"):
        attn(torch.randn(3, 16), torch.arange(3))
    with pytest.raises(ValueError, match=r"d_model=16\), got \(3, 12\)"):
        attn(torch.randn(3, 12))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [False, True])
def test_kv_cache_decoding_matches_full_attention(backend, fused, device):
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=32, device=device)
    attn = CausalMultiHeadSelfAttention(32, 4, rope=rope, device=device, attention_backend=backend, fused=fused)
    x = torch.randn(2, 12, 32, device=device)
    full = attn(x)
    cache = KVCache(2, 4, capacity=12, d_head=8, device=device)
    steps = [attn(x[:, :5], kv_cache=cache)]  # a prefix, then one token at a time
    steps += [attn(x[:, t : t + 1], kv_cache=cache) for t in range(5, 9)]
    steps.append(attn(x[:, 9:], kv_cache=cache))  # a chunk of three after the cache
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-6)


def test_fused_state_dict_keeps_course_keys_and_loads_both_ways():
    fused = CausalMultiHeadSelfAttention(16, 2, fused=True)
    keys = {f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "output_proj")}
    assert set(fused.state_dict()) == keys
    plain = CausalMultiHeadSelfAttention(16, 2, fused=False)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(3, 16)
    torch.testing.assert_close(plain(x), fused(x), rtol=1e-5, atol=1e-6)


def test_backend_is_validated_and_switchable():
    attn = CausalMultiHeadSelfAttention(16, 2)
    assert attn.attention_backend == "auto"
    attn.attention_backend = "blockwise"
    with pytest.raises(
        ValueError, match=r"backend must be one of \('auto', 'reference', 'blockwise', 'torch'\), got 'flash'"
    ):
        attn.attention_backend = "flash"
    with pytest.raises(ValueError, match="backend must be one of"):
        CausalMultiHeadSelfAttention(16, 2, attention_backend="fast")
