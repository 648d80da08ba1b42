"""Document masking: ids, positions and the mask re-derived by hand, and the attention module on a packed
window equal to each document run alone, on every backend."""

import pytest
import torch

from tlm_attention import (
    CausalMultiHeadSelfAttention,
    KVCache,
    document_ids,
    document_mask,
    document_positions,
)
from tlm_rope import RotaryPositionalEmbedding

EOT = 0
# Two windows: one cut in the middle of a document (no end-of-text at its start), one starting on a boundary
# and ending on one; consecutive end-of-text tokens make a one-token document.
TOKENS = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 0, 4], [0, 3, 3, 3, 0, 2, 2, 1, 0]])


def test_ids_positions_and_mask_match_a_hand_count():
    ids = document_ids(TOKENS, EOT)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 2, 2, 2, 2]]
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 0, 1, 2, 3, 0, 1, 2, 3]]
    mask = document_mask(ids)
    assert mask.shape == (2, 1, 9, 9)
    for b in range(2):
        for i in range(9):
            for j in range(9):
                assert bool(mask[b, 0, i, j]) == (j <= i and ids[b, i] == ids[b, j])


def test_unbatched_tokens_and_a_window_without_boundaries():
    ids = document_ids(torch.tensor([4, 4, 4]), EOT)
    assert ids.tolist() == [0, 0, 0] and document_positions(ids).tolist() == [0, 1, 2]
    torch.testing.assert_close(document_mask(ids)[0], torch.ones(3, 3, dtype=torch.bool).tril())


@pytest.mark.parametrize("backend", ["reference", "blockwise", "torch"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_packed_window_equals_each_document_alone(backend, kv_heads):
    torch.manual_seed(0)
    rope = RotaryPositionalEmbedding(10_000.0, 8, 16)
    attn = CausalMultiHeadSelfAttention(32, 4, rope, attention_backend=backend, num_kv_heads=kv_heads)
    x = torch.randn(2, 9, 32)
    ids = document_ids(TOKENS, EOT)
    packed = attn(x, document_positions(ids), document_ids=ids)
    for b in range(2):
        for doc in ids[b].unique().tolist():
            where = (ids[b] == doc).nonzero().squeeze(-1)
            alone = attn(x[b : b + 1, where])  # positions 0.. of its own
            torch.testing.assert_close(packed[b : b + 1, where], alone, rtol=1e-5, atol=1e-6)


def test_document_ids_with_a_kv_cache_are_refused():
    attn = CausalMultiHeadSelfAttention(32, 4)
    cache = KVCache(1, 4, 8, 8)
    with pytest.raises(ValueError, match="document_ids"):
        attn(torch.randn(1, 3, 32), kv_cache=cache, document_ids=torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("causal", [False, True], ids=["every-block", "future-blocks-skipped"])
@pytest.mark.parametrize("block_size", [2, 3, 16])
def test_blockwise_applies_a_mask_block_by_block_equal_to_torch(block_size, causal):
    import torch.nn.functional as F

    from tlm_attention import blockwise_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = document_mask(document_ids(TOKENS, EOT))
    # A document mask lies within the causal one: skipping future blocks (causal=True) changes nothing.
    got = blockwise_attention(q, k, v, causal=causal, block_size=block_size, mask=mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
