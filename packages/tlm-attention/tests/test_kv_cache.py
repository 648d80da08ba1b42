import pytest
import torch

from tlm_attention import KVCache


def test_update_appends_and_returns_everything_stored():
    cache = KVCache(2, 3, capacity=10, d_head=4)
    k1, v1 = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    k, v = cache.update(k1, v1)
    assert cache.length == 4 and torch.equal(k, k1) and torch.equal(v, v1)
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    k, v = cache.update(k2, v2)
    assert cache.length == 5
    assert torch.equal(k, torch.cat([k1, k2], dim=2)) and torch.equal(v, torch.cat([v1, v2], dim=2))
    cache.reset()
    assert cache.length == 0


def test_overflow_and_shape_errors():
    cache = KVCache(1, 2, capacity=3, d_head=4)
    with pytest.raises(ValueError, match="holds 3 tokens; 0 stored \\+ 4 new is too many"):
        cache.update(torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4))
    with pytest.raises(ValueError, match=r"\(batch, heads, new, d_head\) = \(1, 2, new, 4\)"):
        cache.update(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))
    with pytest.raises(ValueError, match="capacity must be a positive int, got 0"):
        KVCache(1, 1, 0, 4)


def test_mismatched_keys_and_values_are_refused_and_change_nothing():
    cache = KVCache(1, 2, capacity=6, d_head=4)
    cache.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    stored = cache.keys.clone(), cache.values.clone()
    for keys, values in [
        (torch.randn(1, 2, 1, 4), torch.randn(1, 2, 2, 4)),  # different numbers of tokens
        (torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 3)),  # different d_head
        (torch.randn(1, 2, 1, 4), torch.randn(2, 2, 1, 4)),  # different batch
        (torch.randn(1, 2, 1), torch.randn(1, 2, 1)),  # no d_head axis
    ]:
        with pytest.raises(ValueError, match=r"keys and values must have shape \(batch, heads, new, d_head\)"):
            cache.update(keys, values)
    assert cache.length == 2
    assert torch.equal(cache.keys, stored[0]) and torch.equal(cache.values, stored[1])


def test_truncate_undoes_an_update_exactly():
    cache = KVCache(1, 2, capacity=6, d_head=4)
    k1, v1 = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    cache.update(k1, v1)
    cache.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    cache.truncate(3)
    k2, v2 = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    k, v = cache.update(k2, v2)
    assert cache.length == 4
    assert torch.equal(k, torch.cat([k1, k2], 2)) and torch.equal(v, torch.cat([v1, v2], 2))
    for bad in (5, -1, 1.0, True):
        with pytest.raises(ValueError, match=r"length must be an int in \[0, 4\]"):
            cache.truncate(bad)
