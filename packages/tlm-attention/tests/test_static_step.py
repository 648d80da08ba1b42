"""Boundaries of the decode path, tested here where they live (they were exercised only through tlm-model's and
tlm-command's tests): a static step reads exactly the ``limit`` slots it is given, and ``torch_attention`` takes
the one-query path for one masked query a row on a CPU only, each against a float64 softmax written out."""

import pytest
import torch

from tlm_attention import CacheStep, CausalMultiHeadSelfAttention, KVCache, backends, cache_mask


def reference(q, k, v, mask):
    """softmax(q k^T / sqrt(d), masked) v in float64, the kv heads repeated for their query heads."""
    groups = q.shape[-3] // k.shape[-3]
    k, v = (t.double().repeat_interleave(groups, dim=-3) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("limit", [5, 6, None])
def test_a_static_step_reads_only_the_slots_up_to_its_limit(limit):
    # 5 tokens a row are written at slots 0..4; a limit of 5 (the occupied prefix, the equal case) or more reads
    # them all and equals attention without a cache; slots past the limit hold NaN, which a read would spread.
    torch.manual_seed(0)
    attention = CausalMultiHeadSelfAttention(16, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 5, 16)
    cache = KVCache(2, 2, 8, 4)
    cache.value_buffers[0][:, :, (limit or 9) :] = float("nan")
    positions = torch.arange(5).expand(2, 5)
    slots = None if limit is None else torch.arange(limit)
    step = CacheStep(cache, 0, positions, None, cache_mask(positions, 8, slots), limit)
    with torch.no_grad():
        got = attention(x, None, step)
        torch.testing.assert_close(got, attention(x), rtol=1e-5, atol=1e-6)
    if limit is not None:  # one slot more would read a NaN value: the limit is what keeps it out
        wider = CacheStep(cache, 0, positions, None, cache_mask(positions, 8, torch.arange(limit + 1)), limit + 1)
        with torch.no_grad():
            assert attention(x, None, wider).isnan().any()


@pytest.mark.parametrize(
    ("queries", "mask_shape", "one_query"),
    [
        (1, (3, 1, 1, 7), True),  # one masked query a row, the mask shared by the heads: the two-matmul path
        (1, (1, 7), True),  # a 2-d mask: shared too
        (2, (3, 1, 2, 7), False),  # two queries: torch's kernel
        (1, (3, 4, 1, 7), False),  # a mask per head: torch's kernel
    ],
)
def test_one_query_dispatch_and_both_paths_equal_a_float64_softmax(monkeypatch, queries, mask_shape, one_query):
    calls = []
    one = backends._one_query_attention
    monkeypatch.setattr(backends, "_one_query_attention", lambda *a: calls.append(1) or one(*a))
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 4, queries, 8, generator=g), torch.randn(3, 2, 7, 8, generator=g), torch.randn(
        3, 2, 7, 8, generator=g)  # fmt: skip
    mask = torch.rand(mask_shape, generator=g) < 0.7
    mask[..., 0] = True  # every query sees one key at least
    got = backends.torch_attention(q, k, v, mask)
    assert bool(calls) is one_query
    torch.testing.assert_close(got.double(), reference(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_an_unmasked_query_sees_the_whole_cache_and_square_inputs_are_causal():
    g = torch.Generator().manual_seed(2)
    q1, q5 = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    k, v = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    everything = torch.ones(1, 5, dtype=torch.bool)
    torch.testing.assert_close(backends.torch_attention(q1, k, v).double(), reference(q1, k, v, everything))
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(backends.torch_attention(q5, k, v).double(), reference(q5, k, v, causal))
    # Three queries after two cached keys: bottom-right aligned (query i sees keys 0 .. 2 + i).
    q3 = q5[:, :, :3]
    offset = torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2)
    torch.testing.assert_close(backends.torch_attention(q3, k, v).double(), reference(q3, k, v, offset))


def test_the_one_query_path_is_for_the_cpu_only():
    # Elsewhere (here the meta device, which computes shapes only) torch's kernel takes it, as on an accelerator.
    calls = []
    one = backends._one_query_attention
    q, k = torch.randn(1, 2, 1, 8, device="meta"), torch.randn(1, 2, 5, 8, device="meta")
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool, device="meta")
    try:
        backends._one_query_attention = lambda *a: calls.append(1) or one(*a)
        assert backends.torch_attention(q, k, k, mask).shape == (1, 2, 1, 8)
    finally:
        backends._one_query_attention = one
    assert calls == []


def test_blockwise_without_a_mask_is_causal_and_kv_of_too_few_dims_are_refused():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=g) for _ in range(3))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    got = backends.blockwise_causal_attention(q, k[:, :2], v[:, :2])  # grouped: 2 kv heads for 4 query heads
    torch.testing.assert_close(got.double(), reference(q, k[:, :2], v[:, :2], causal), rtol=1e-5, atol=1e-6)
    for bad in (k[0, 0], k[0, 0, 0]):  # (keys, d) and (d,): no heads axis
        with pytest.raises(ValueError, match="q must have shape"):
            backends.torch_attention(q, bad, bad)
