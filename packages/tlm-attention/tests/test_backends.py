import io
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

import tlm_attention.backends as backends_module
from tlm_attention import (
    BACKENDS,
    CausalMultiHeadSelfAttention,
    attention_function,
    causal_attention,
    resolve_attention_backend,
)


def bottom_right_causal_reference(q, k, v):
    """float64 softmax(QKᵀ/√d)V with query i seeing keys j <= i + (keys - queries), from torch built-ins."""
    q, k, v = q.double(), k.double(), v.double()
    num_q, num_k = q.shape[-2], k.shape[-2]
    mask = torch.ones(num_q, num_k, dtype=torch.bool).tril(num_k - num_q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("num_q, num_k", [(7, 7), (1, 9), (3, 9)])
def test_every_backend_is_bottom_right_causal_attention(name, num_q, num_k):
    q, k, v = torch.randn(2, 3, num_q, 8), torch.randn(2, 3, num_k, 8), torch.randn(2, 3, num_k, 8)
    got = causal_attention(q, k, v, attention_backend=name)
    torch.testing.assert_close(got.double(), bottom_right_causal_reference(q, k, v), rtol=1e-5, atol=1e-6)


def test_each_name_is_one_of_the_three_implementations():
    assert BACKENDS == ("auto", "reference", "blockwise", "torch")
    assert attention_function("reference") is backends_module.reference_attention
    assert attention_function("blockwise") is backends_module.blockwise_causal_attention
    assert attention_function("torch") is backends_module.torch_attention is attention_function("auto")
    # A document mask lies within the causal one: only blockwise has anything to gain (it skips future blocks).
    assert attention_function("blockwise", within_causal=True) is backends_module._blockwise_within_causal
    assert attention_function("torch", within_causal=True) is backends_module.torch_attention


def test_auto_is_torch():
    assert resolve_attention_backend("auto") == "torch"
    assert resolve_attention_backend("reference") == "reference"


@pytest.mark.parametrize("bad", ["flash", "", None, 3, "Auto"])
def test_unknown_names_are_refused_everywhere(bad):
    message = r"attention_backend must be one of \('auto', 'reference', 'blockwise', 'torch'"
    with pytest.raises(ValueError, match=message):
        resolve_attention_backend(bad)
    with pytest.raises(ValueError, match=message):
        attention_function(bad)
    with pytest.raises(ValueError, match=message):
        causal_attention(*torch.randn(3, 1, 4, 8), attention_backend=bad)
    with pytest.raises(ValueError, match=message):
        CausalMultiHeadSelfAttention(16, 2, attention_backend=bad)
    attn = CausalMultiHeadSelfAttention(16, 2, attention_backend="reference")
    with pytest.raises(ValueError, match=message):
        attn.attention_backend = bad
    assert attn.attention_backend == "reference" == attn.resolved_attention_backend  # unchanged


def test_module_resolves_once_and_setter_re_resolves():
    attn = CausalMultiHeadSelfAttention(16, 2)
    assert (attn.attention_backend, attn.resolved_attention_backend) == ("auto", "torch")
    attn.attention_backend = "blockwise"
    assert (attn.attention_backend, attn.resolved_attention_backend) == ("blockwise", "blockwise")
    assert "attention_backend='blockwise'" in repr(attn)


@pytest.mark.parametrize("fused", [True, False])
def test_attention_pickles_and_saves_whole(fused):
    attn = CausalMultiHeadSelfAttention(16, 2, fused=fused, attention_backend="blockwise")
    x = torch.randn(2, 5, 16)
    buffer = io.BytesIO()
    torch.save(attn, buffer)
    buffer.seek(0)
    for copy in (pickle.loads(pickle.dumps(attn)), torch.load(buffer, weights_only=False)):
        assert copy.attention_backend == "blockwise"
        torch.testing.assert_close(copy(x), attn(x), rtol=0, atol=0)
        assert set(copy.state_dict()) == {f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "output_proj")}


def test_defaults_are_fused_and_auto():
    attn = CausalMultiHeadSelfAttention(16, 2)
    assert attn.fused and hasattr(attn, "qkv_proj") and not hasattr(attn, "q_proj")
    assert attn.attention_backend == "auto"


def repeat_kv_reference(q, k, v, mask=None):
    """Causal SDPA after repeating each kv head over its query group, as HF's repeat_kv does."""
    groups = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(groups, dim=-3) for t in (k, v))
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


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


@pytest.mark.parametrize("backend", ["reference", "blockwise", "torch"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_one_query_a_row_under_a_mask_matches_float64_sdpa(backend, heads, kv_heads, device):
    # A decode step over rows of different lengths: one query a row, each row blind past its own length (on a
    # CPU the torch backend runs its own two matmuls here, not torch's fused kernel). Values and gradients
    # against float64 SDPA of the repeated kv heads.
    torch.manual_seed(3)
    q = torch.randn(3, heads, 1, 8, device=device, requires_grad=True)
    k = torch.randn(3, kv_heads, 11, 8, device=device, requires_grad=True)
    v = torch.randn(3, kv_heads, 11, 8, device=device, requires_grad=True)
    lengths = torch.tensor([11, 4, 1], device=device)
    mask = (torch.arange(11, device=device) < lengths[:, None]).view(3, 1, 1, 11)
    got = attention_function(backend)(q, k, v, mask=mask)
    want = repeat_kv_reference(q.double(), k.double(), v.double(), mask)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expected = torch.autograd.grad(want.square().sum(), (q, k, v))
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


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
@pytest.mark.parametrize("num_q, num_k", [(1, 1), (1, 6), (3, 7), (4, 4)])
def test_causal_attention_is_bottom_right_aligned(backend, num_q, num_k):
    q = torch.randn(2, 3, num_q, 8, dtype=torch.float64)
    k, v = torch.randn(2, 3, num_k, 8, dtype=torch.float64), torch.randn(2, 3, num_k, 8, dtype=torch.float64)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    visible = torch.arange(num_k) <= torch.arange(num_q).unsqueeze(-1) + (num_k - num_q)
    expected = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v
    torch.testing.assert_close(causal_attention(q, k, v, backend), expected, rtol=1e-10, atol=1e-10)
