"""Paths of tlm-attention that only other packages' tests (or slow ones) used to reach: FlexAttention's default
block size and its compile-once cache, and KVCache.copy_from, each checked here without compiling."""

import pytest
import torch

from tlm_attention import KVCache, document_mask
from tlm_attention import documents as documents_module
from tlm_attention.documents import document_block_mask, flex_document_attention


def test_the_default_block_is_flexattentions_own_default():
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE

    ids = torch.cat([torch.zeros(1, 100, dtype=torch.long), torch.ones(1, 156, dtype=torch.long)], dim=1)
    mask = document_block_mask(ids)
    assert mask.BLOCK_SIZE == (_DEFAULT_SPARSE_BLOCK_SIZE, _DEFAULT_SPARSE_BLOCK_SIZE) == (128, 128)
    dense = document_mask(ids).reshape(1, 2, 128, 2, 128).any(-1).any(-2)
    assert torch.equal(mask.to_dense()[:, 0].bool(), dense)


def test_flex_document_attention_compiles_once_per_process_and_reuses_it(monkeypatch):
    compiled, calls = [], []

    def fake_flex(q, k, v, block_mask, enable_gqa, **kwargs):
        calls.append((block_mask.BLOCK_SIZE, enable_gqa))
        return q

    def fake_compile(function, **options):
        from torch.nn.attention.flex_attention import flex_attention

        compiled.append((function is flex_attention, options))
        return fake_flex

    monkeypatch.setattr(documents_module, "_FLEX", None)
    monkeypatch.setattr(torch, "compile", fake_compile)
    q, kv = torch.randn(1, 4, 128, 8), torch.randn(1, 2, 128, 8)
    ids = torch.zeros(1, 128, dtype=torch.long)
    for _ in range(2):
        assert flex_document_attention(q, kv, kv, ids) is q
    assert compiled == [(True, {"dynamic": False})]  # once: the second call reuses it
    assert calls == [((128, 128), True)] * 2
    flex_document_attention(q, q, q, ids)
    assert calls[-1] == ((128, 128), False)  # as many kv heads as query heads: no GQA


def test_copy_from_takes_another_caches_rows_and_refuses_another_shape():
    generator = torch.Generator().manual_seed(0)
    source, target = KVCache(3, 2, 8, 4, layers=2), KVCache(3, 2, 8, 4, layers=2)
    for buffer in (*source.key_buffers, *source.value_buffers):
        buffer.copy_(torch.randn(buffer.shape, generator=generator))
    source.select_rows([0, 1])  # two of its three rows in use
    source.advance([5, 3])
    target.copy_from(source)
    assert target.lengths == (5, 3) and target.batch_size == 2
    mine, theirs = (*target.key_buffers, *target.value_buffers), (*source.key_buffers, *source.value_buffers)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    # The buffers hold one slot past the capacity (where padding writes).
    with pytest.raises(
        ValueError,
        match=r"^source must have this cache's \(layers, \*buffer shape\) \(2, 3, 2, 9, 4\), got \(2, 3, 2, 10, 4\)$",
    ):
        target.copy_from(KVCache(3, 2, 9, 4, layers=2))
    with pytest.raises(ValueError, match=r"got \(1, 3, 2, 9, 4\)$"):
        target.copy_from(KVCache(3, 2, 8, 4))


def test_write_stores_keys_computed_in_another_dtype_in_the_caches_own():
    # Under autocast the keys may come in bfloat16 while the cache holds float32 (or the reverse): stored rounded.
    cache = KVCache(2, 2, 4, 8, dtype=torch.bfloat16)
    keys, values = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    positions = torch.tensor([[0, 1, 2], [1, 2, 4]])  # 4 = the capacity: the scratch slot
    got_keys, got_values = cache.write(0, keys, values, positions)
    assert got_keys.dtype == got_values.dtype == torch.bfloat16
    for b in range(2):
        for n in range(3):
            slot = int(positions[b, n])
            assert torch.equal(got_keys[b, :, slot], keys[b, :, n].to(torch.bfloat16))
            assert torch.equal(got_values[b, :, slot], values[b, :, n].to(torch.bfloat16))
