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
    with pytest.raises(ValueError, match="capacity must be positive, got 0"):
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
    for bad in (5, -1):
        with pytest.raises(ValueError, match=rf"length must be in \[0, 4\], got {bad}"):
            cache.truncate(bad)
    for bad in (1.0, True):
        with pytest.raises(TypeError, match=f"length must be an int, got {type(bad).__name__}"):
            cache.truncate(bad)


# Shape checks (issue 9, item 6): mismatched keys and values are refused before anything is stored.
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


@pytest.mark.parametrize(
    ("bad", "exc", "message"),
    [(True, TypeError, "must be an int, got bool"), (1.0, TypeError, "must be an int, got float"),
     ("2", TypeError, "must be an int, got str"), (-1, ValueError, "must be positive, got -1"),
     (0, ValueError, "must be positive, got 0")],
)  # fmt: skip
@pytest.mark.parametrize("name", ["batch_size", "num_heads", "capacity", "d_head"])
def test_constructor_arguments_must_be_positive_ints(name, bad, exc, message):
    kwargs = dict(batch_size=1, num_heads=1, capacity=1, d_head=2)
    kwargs[name] = bad
    with pytest.raises(exc, match=f"{name} {message}"):
        KVCache(**kwargs)


# Rows of their own lengths (issue 25): expected contents are built by hand from the tokens written.
def test_rows_of_different_lengths_write_each_at_its_own_positions():
    cache = KVCache(2, 1, capacity=6, d_head=2)
    k, v = torch.randn(2, 1, 3, 2), torch.randn(2, 1, 3, 2)
    cache.update(k, v)
    cache.truncate([3, 1])  # row 1 keeps its first token only
    assert cache.lengths == (3, 1) and cache.ragged and cache.length == 3
    assert torch.equal(cache.positions(2), torch.tensor([[3, 4], [1, 2]]))
    k2, v2 = torch.randn(2, 1, 2, 2), torch.randn(2, 1, 2, 2)
    got_k, got_v = cache.update(k2, v2, cache.positions(2))
    assert cache.lengths == (5, 3) and got_k.shape == (2, 1, 5, 2)
    assert torch.equal(got_k[0], torch.cat([k[0], k2[0]], 1)) and torch.equal(got_v[0], torch.cat([v[0], v2[0]], 1))
    assert torch.equal(got_k[1, :, :3], torch.cat([k[1, :, :1], k2[1]], 1))
    with pytest.raises(ValueError, match=r"different numbers of tokens \(5, 3\): update needs positions"):
        cache.update(k2[:, :, :1], v2[:, :, :1])
    cache.truncate([3, 3])
    assert not cache.ragged and cache.length == 3
    with pytest.raises(ValueError, match=r"length must be in \[0, 3\], got 4"):
        cache.truncate([4, 3])
    with pytest.raises(ValueError, match=r"length must hold one int per row \(2\), got 1"):
        cache.truncate([1])


def test_rows_leave_join_and_are_replaced_between_steps():
    cache = KVCache(3, 1, capacity=4, d_head=2)
    k = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 1, 4, 2)
    cache.update(k, -k)
    cache.truncate([4, 2, 3])
    cache.select_rows([2, 0])  # row 1 leaves; the others swap places
    assert cache.batch_size == 2 and cache.lengths == (3, 4)
    assert torch.equal(cache.keys[0], k[2]) and torch.equal(cache.keys[1], k[0]) and torch.equal(cache.values[0], -k[2])
    joining = KVCache(1, 1, capacity=2, d_head=2)
    new = torch.randn(1, 1, 2, 2)
    joining.update(new, new)
    assert cache.append_row(joining) == 2
    assert cache.lengths == (3, 4, 2) and torch.equal(cache.keys[2, :, :2], new[0])
    with pytest.raises(ValueError, match="room for 3 rows, all in use"):
        cache.append_row(joining)
    cache.set_row(1, joining)
    assert cache.lengths == (3, 2, 2) and torch.equal(cache.values[1, :, :2], new[0])
    for bad, match in (([0, 0], "must not repeat a row, got \\[0, 0\\]"), ([5], r"rows must be in \[0, 2\], got 5")):
        with pytest.raises(ValueError, match=match):
            cache.select_rows(bad)
    assert cache.lengths == (3, 2, 2)
    cache.select_rows([])
    assert cache.batch_size == 0 and cache.length == 0


# Static use (issue 34): writes in place at each row's slots, whole buffers back, lengths on the device.
def test_write_stores_at_each_rows_slots_and_advance_records_the_lengths():
    cache = KVCache(3, 2, capacity=5, d_head=4)
    cache.select_rows([0, 1])
    cache.advance([2, 0])
    keys, values = torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4)
    positions = torch.tensor([[2, 3], [0, 5]])  # row 1's second token is padding: the scratch slot
    got_k, _ = cache.write(keys, values, positions)
    assert got_k.shape == (2, 2, 6, 4) and got_k.data_ptr() == cache.key_buffer.data_ptr()
    assert cache.lengths == (2, 0)  # write changes no host state
    assert torch.equal(cache.key_buffer[0, :, 2:4], keys[0]) and torch.equal(cache.value_buffer[0, :, 2:4], values[0])
    assert torch.equal(cache.key_buffer[1, :, 0], keys[1, :, 0])
    assert torch.equal(cache.key_buffer[1, :, 5], keys[1, :, 1])
    assert cache.keys.shape == (2, 2, 5, 4)  # the rows in use, without the scratch slot
    cache.advance([2, 1])
    assert cache.lengths == (4, 1) and cache.device_lengths[:2].tolist() == [4, 1]
    assert torch.equal(cache.positions(2), torch.tensor([[4, 5], [1, 2]]))
    rows_k, _ = cache.write(keys[:1, :, :1], values[:1, :, :1], torch.tensor([[1]]), rows=torch.tensor([1]))
    assert torch.equal(rows_k[0], cache.key_buffer[1]) and torch.equal(cache.key_buffer[1, :, 1], keys[0, :, 0])
    with pytest.raises(ValueError, match=r"holds 5 tokens per row; \(4, 1\) \+ \[2, 0\] does not fit"):
        cache.advance([2, 0])
    with pytest.raises(ValueError, match=r"new must hold one int per row \(2\), got 1"):
        cache.advance([1])
    assert cache.lengths == (4, 1)


def test_device_lengths_follow_every_host_change():
    cache = KVCache(3, 1, capacity=6, d_head=2)
    cache.update(torch.randn(3, 1, 4, 2), torch.randn(3, 1, 4, 2))
    cache.truncate([4, 1, 2])
    cache.update(torch.randn(3, 1, 1, 2), torch.randn(3, 1, 1, 2), cache.positions(1))
    assert cache.device_lengths.tolist() == [5, 2, 3] == list(cache.lengths)
    cache.select_rows([2, 0])
    assert cache.device_lengths[:2].tolist() == [3, 5] == list(cache.lengths)
    assert cache.append_empty_row() == 2 and cache.lengths == (3, 5, 0) and cache.device_lengths[2] == 0
    cache.truncate([2, 2, 0])
    assert cache.device_lengths.tolist() == [2, 2, 0]
    cache.reset()
    assert cache.device_lengths.tolist() == [0, 0, 0] and cache.length == 0


def test_cache_mask_reads_the_slots_up_to_each_position_and_the_scratch_slot_only_for_padding():
    from tlm_attention import cache_mask

    mask = cache_mask(torch.tensor([[0, 2], [3, 4]]), capacity=4)
    assert mask.shape == (2, 1, 2, 5)
    expected = torch.tensor([[[1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]], dtype=torch.bool)
    assert torch.equal(mask[:, 0], expected)
    # Over the first 3 slots only (a step that reads the occupied prefix): the same entries, cut there.
    assert torch.equal(cache_mask(torch.tensor([[0, 2], [3, 4]]), capacity=4, slots=torch.arange(3))[:, 0],
                       expected[..., :3])  # fmt: skip


@pytest.mark.slow
def test_a_compiled_write_stores_the_new_entries_only_never_a_copy_of_the_buffer():
    # ~20 s (one inductor C++ build). The write must not grow with the capacity: inductor's code for it has
    # no loop as long as a buffer's slots and no copy of a buffer back into the cache.
    import re

    from torch._inductor.utils import run_and_get_code

    capacity = 999
    cache = KVCache(2, 2, capacity=capacity, d_head=8)
    keys, values = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    positions = torch.tensor([[3], [7]])

    def write(k, v, p):
        cache.write(k, v, p)

    _, (code,) = run_and_get_code(torch.compile(write, dynamic=False, fullgraph=True), keys, values, positions)
    bounds = [int(n) for n in re.findall(r"x\d+<static_cast<int64_t>\((\d+)L\)", code)]
    assert bounds and max(bounds) < capacity, bounds  # loops over (batch, heads, d_head), never the slots
    assert ".copy_(" not in code and "capacity" not in code
    assert torch.equal(cache.key_buffer[0, :, 3], keys[0, :, 0])
    assert torch.equal(cache.value_buffer[1, :, 7], values[1, :, 0])
    assert cache.key_buffer[0, :, 4:].abs().sum() == 0


def test_several_empty_rows_join_at_once():
    # Issue 41: generate's batch of thousands of rows joins in one go, not one host-side copy per row.
    cache = KVCache(5, 2, 8, 4)
    cache.select_rows([0])
    cache.advance([3])
    assert cache.append_empty_row(3) == 1 and cache.lengths == (3, 0, 0, 0)
    assert cache.device_lengths[:4].tolist() == [3, 0, 0, 0]
    with pytest.raises(ValueError, match=r"room for 5 rows; 4 in use \+ 2 new is too many"):
        cache.append_empty_row(2)
