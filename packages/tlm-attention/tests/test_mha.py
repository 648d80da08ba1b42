import math

import pytest
import torch
import torch.nn.functional as F
from attention_numerics import fixture_ok, seeds
from hypothesis import given
from hypothesis import strategies as st

from tlm_attention import (
    BACKENDS,
    CausalMultiHeadSelfAttention,
    KVCache,
)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_nope_with_a_kv_cache_is_sdpa_on_the_unrotated_projections(backend, device):
    # No rotary module: the prefix and each decoded token attend over the cache exactly as causal SDPA does over
    # the whole sequence, with q and k as projected.
    attn = CausalMultiHeadSelfAttention(32, 4, device=device, attention_backend=backend, num_kv_heads=2)
    x = torch.randn(2, 9, 32, device=device)
    weights = attn.state_dict()
    q, k, v = (
        F.linear(x, weights[f"{p}.weight"]).unflatten(-1, (-1, 8)).transpose(1, 2)
        for p in ("q_proj", "k_proj", "v_proj")
    )
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = F.linear(out.transpose(1, 2).flatten(-2), weights["output_proj.weight"])
    cache = KVCache(2, 2, capacity=9, d_head=8, device=device)
    steps = [attn(x[:, :6], kv_cache=cache)] + [attn(x[:, t : t + 1], kv_cache=cache) for t in range(6, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-5, atol=1e-6)


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
    assert cache.lengths == (12, 12)
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


# Property-based (hypothesis; the profile in the root conftest.py decides how many examples run).
MHA_DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@st.composite
def mha_case(draw):
    heads = draw(st.integers(1, 4))
    d_head = 2 * draw(st.integers(1, 4))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    seq = draw(st.integers(1, 8))
    rope = draw(st.booleans())
    offset = draw(st.integers(0, 8)) if rope else 0
    options = {"attention_backend": draw(st.sampled_from(BACKENDS)), "fused": draw(st.booleans())}
    return heads, d_head, batch, seq, rope, offset, options, draw(st.sampled_from(MHA_DTYPES)), draw(seeds)


def build_mha(heads, d_head, rope, offset, seq, options, dtype, seed, device):
    torch.manual_seed(seed)  # the module draws its initial weights from the global generator
    d_model = heads * d_head
    table = RotaryPositionalEmbedding(10_000.0, d_head, max_seq_len=16, device=device) if rope else None
    attn = CausalMultiHeadSelfAttention(d_model, heads, rope=table, device=device, dtype=dtype, **options)
    positions = torch.arange(offset, offset + seq, device=device) if rope else None
    return attn, positions


@fixture_ok
@given(case=mha_case(), data=st.data())
def test_mha_output_at_t_ignores_inputs_after_t(case, data, device):
    heads, d_head, batch, seq, rope, offset, options, dtype, seed = case
    attn, positions = build_mha(heads, d_head, rope, offset, seq, options, dtype, seed, device)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, seq, heads * d_head, generator=g).to(device=device, dtype=dtype)
    t = data.draw(st.integers(0, seq - 1), label="t")
    changed = x.clone()
    changed[..., t + 1 :, :] = torch.randn(changed[..., t + 1 :, :].shape, generator=g).to(device=device, dtype=dtype)
    # Later keys get weight exp(-inf) = 0 exactly, and shapes (so kernels) are unchanged: the
    # outputs up to t must be bitwise equal, not merely close.
    assert torch.equal(attn(x, positions)[..., : t + 1, :], attn(changed, positions)[..., : t + 1, :])


@fixture_ok
@given(case=mha_case(), rows=st.integers(2, 4), data=st.data())
def test_mha_batch_row_ignores_other_rows(case, rows, data, device):
    heads, d_head, batch, seq, rope, offset, options, dtype, seed = case
    attn, positions = build_mha(heads, d_head, rope, offset, seq, options, dtype, seed, device)
    g = torch.Generator().manual_seed(seed)
    shape = (rows, *batch, seq, heads * d_head)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    b = data.draw(st.integers(0, rows - 1), label="row")
    changed = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    changed[b] = x[b]
    # Same shapes, so the same kernels: row b's output must be bitwise equal.
    assert torch.equal(attn(x, positions)[b], attn(changed, positions)[b])


# Grouped-/multi-query attention and a free head_dim, against torch built-ins.
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
    assert cache.key_buffers[0].shape == (2, 2, 17, 4)  # 16 slots and the scratch slot
    torch.testing.assert_close(torch.cat(steps, dim=1), attn(x), rtol=1e-5, atol=1e-6)


def test_cache_with_query_heads_is_refused():
    attn = CausalMultiHeadSelfAttention(32, 8, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"kv_cache must hold \(heads, d_head\) = \(2, 4\), got \(8, 4\)"):
        attn(torch.randn(1, 3, 32), kv_cache=KVCache(1, 8, 8, 4))


def test_head_dim_frees_d_model_from_divisibility():
    attn = CausalMultiHeadSelfAttention(30, 4, head_dim=8)
    assert attn(torch.randn(2, 3, 30)).shape == (2, 3, 30)
    with pytest.raises(ValueError, match="or set head_dim"):
        CausalMultiHeadSelfAttention(30, 4)


# The fused q/k/v projection's initialisation statistics (issue 9, item 6). Each of q, k and v is a (d_model, d_model)
# matrix, so the course's N(0, 2 / (d_in + d_out)) truncated at ±3σ gives σ² = 1 / d_model whether the three are
# stored apart or stacked. The expected std of the truncated normal is a closed form.
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


# With a KV cache (issue 9, item 6): attention over chunks equals torch's SDPA over the whole sequence.
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
    assert cache.lengths == (sum(chunks),) * 2
    torch.testing.assert_close(torch.cat(outs, dim=1).double(), expected, rtol=1e-4, atol=1e-5)
