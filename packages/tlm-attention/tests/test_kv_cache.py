import pytest
import torch

from tlm_attention import KVCache


def _write(cache, layer, keys, positions):
    """Write ``keys`` (batch, heads, new, d_head) and their negatives as values at ``positions`` of layer ``layer``."""
    cache.write(layer, keys, -keys, positions)


def test_continuation_continues_every_row_at_its_own_length_and_refuses_to_pass_the_capacity():
    cache = KVCache(2, 1, capacity=6, d_head=2)
    cache.advance([3, 1])
    positions, slots = cache.continuation(2)
    assert positions.tolist() == [[3, 4], [1, 2]] and slots.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"the KV cache holds 6 tokens; 3 stored \+ 4 new is too many"):
        cache.continuation(4)
    with pytest.raises(ValueError, match="new must be positive, got 0"):
        cache.continuation(0)
    assert cache.lengths == (3, 1)


def test_lengths_live_once_for_every_layer_and_truncate_cuts_them_back():
    cache = KVCache(2, 1, capacity=6, d_head=2, layers=3)
    keys = torch.randn(2, 1, 4, 2)
    for layer in range(3):
        _write(cache, layer, keys * layer, torch.arange(4).expand(2, 4))
    cache.advance([4, 4])
    assert cache.lengths == (4, 4) and cache.device_lengths.tolist() == [4, 4]
    assert all(torch.equal(cache.key_buffers[i][:, :, :4], keys * i) for i in range(3))
    assert all(torch.equal(cache.value_buffers[i][:, :, :4], -keys * i) for i in range(3))
    cache.truncate([3, 1])  # row 1 keeps its first token only
    assert cache.lengths == (3, 1) and cache.device_lengths.tolist() == [3, 1]
    assert cache.continuation(1)[0].tolist() == [[3], [1]]
    with pytest.raises(ValueError, match=r"lengths must be in \[0, 1\], got 2"):
        cache.truncate([3, 2])
    with pytest.raises(ValueError, match=r"lengths must hold one int per row \(2\), got 1"):
        cache.truncate([1])
    with pytest.raises(TypeError, match="lengths must be a sequence of ints, one per row, got int"):
        cache.truncate(3)
    cache.reset()
    assert cache.lengths == (0, 0) and cache.device_lengths.tolist() == [0, 0]


def test_rows_leave_join_and_are_copied_between_steps():
    cache = KVCache(3, 1, capacity=4, d_head=2, layers=2)
    k = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 1, 4, 2)
    for layer in range(2):
        _write(cache, layer, k + layer, torch.arange(4).expand(3, 4))
    cache.advance([4, 4, 4])
    cache.truncate([4, 2, 3])
    cache.select_rows([2, 0])  # row 1 leaves; the others swap places, in every layer
    assert cache.batch_size == 2 and cache.lengths == (3, 4) and cache.device_lengths[:2].tolist() == [3, 4]
    for layer in range(2):
        assert torch.equal(cache.key_buffers[layer][0, :, :4], k[2] + layer)
        assert torch.equal(cache.key_buffers[layer][1, :, :4], k[0] + layer)
        assert torch.equal(cache.value_buffers[layer][0, :, :4], -k[2] - layer)
    assert cache.append_empty_row() == 2 and cache.lengths == (3, 4, 0) and cache.device_lengths[2] == 0
    with pytest.raises(ValueError, match="room for 3 rows, all in use"):
        cache.append_empty_row()
    for bad, match in (([0, 0], "must not repeat a row, got \\[0, 0\\]"), ([5], r"rows must be in \[0, 2\], got 5")):
        with pytest.raises(ValueError, match=match):
            cache.select_rows(bad)
    assert cache.lengths == (3, 4, 0)
    other = KVCache(3, 1, capacity=4, d_head=2, layers=2)
    other.copy_from(cache)
    assert other.lengths == (3, 4, 0) and other.device_lengths.tolist()[:3] == [3, 4, 0]
    pairs = zip(other.key_buffers + other.value_buffers, cache.key_buffers + cache.value_buffers, strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    with pytest.raises(ValueError, match=r"source must have this cache's \(layers, \*buffer shape\) "):
        KVCache(3, 1, capacity=4, d_head=2).copy_from(cache)
    cache.select_rows([])
    assert cache.batch_size == 0


def test_rows_left_out_can_keep_their_slots_past_the_rows_in_use_and_rows_copy_any_prefix():
    cache = KVCache(4, 1, capacity=4, d_head=2, layers=2)
    cache.select_rows([0, 1, 2])
    keys = torch.arange(3 * 8, dtype=torch.float32).view(3, 1, 4, 2)
    for layer in range(2):
        _write(cache, layer, keys + layer, torch.arange(4).expand(3, 4))
    cache.advance([4, 2, 3])
    cache.select_rows([0, 2], keep_rest=True)  # row 1 leaves: row 2 takes its place, row 1's slots go to row 2
    assert cache.lengths == (4, 3) and cache.device_lengths.tolist() == [4, 3, 4, 4]  # not in use: capacity
    for layer in range(2):
        assert torch.equal(cache.key_buffers[layer][1, :, :3], keys[2, :, :3] + layer)
        assert torch.equal(cache.key_buffers[layer][2, :, :2], keys[1, :, :2] + layer)
        assert torch.equal(cache.value_buffers[layer][2, :, :2], -keys[1, :, :2] - layer)
    cache.copy_rows([3, 0], [0, 2], 2)  # sources read first: row 0's slots reach row 3 before row 0 changes
    assert cache.lengths == (4, 3)
    for layer in range(2):
        assert torch.equal(cache.key_buffers[layer][3, :, :2], keys[0, :, :2] + layer)
        assert torch.equal(cache.key_buffers[layer][0, :, :2], keys[1, :, :2] + layer)
        assert torch.equal(cache.key_buffers[layer][0, :, 2:4], keys[0, :, 2:4] + layer)
    assert cache.append_empty_row(held=2) == 2 and cache.lengths == (4, 3, 2)


@pytest.mark.parametrize(
    ("bad", "exc", "message"),
    [(True, TypeError, "must be an int, got bool"), (1.0, TypeError, "must be an int, got float"),
     ("2", TypeError, "must be an int, got str"), (-1, ValueError, "must be positive, got -1"),
     (0, ValueError, "must be positive, got 0")],
)  # fmt: skip
@pytest.mark.parametrize("name", ["batch_size", "num_heads", "capacity", "d_head", "layers"])
def test_constructor_arguments_must_be_positive_ints(name, bad, exc, message):
    kwargs = dict(batch_size=1, num_heads=1, capacity=1, d_head=2)
    kwargs[name] = bad
    with pytest.raises(exc, match=f"{name} {message}"):
        KVCache(**kwargs)


# Static use (issue 34): writes in place at each row's slots, whole buffers back, lengths on the device.
def test_write_stores_at_each_rows_slots_and_advance_records_the_lengths():
    cache = KVCache(3, 2, capacity=5, d_head=4)
    cache.select_rows([0, 1])
    cache.advance([2, 0])
    keys, values = torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4)
    positions = torch.tensor([[2, 3], [0, 5]])  # row 1's second token is padding: the scratch slot
    got_k, _ = cache.write(0, keys, values, positions)
    key_buffer, value_buffer = cache.key_buffers[0], cache.value_buffers[0]
    assert got_k.shape == (2, 2, 6, 4) and got_k.data_ptr() == key_buffer.data_ptr()
    assert cache.lengths == (2, 0)  # write changes no host state
    assert torch.equal(key_buffer[0, :, 2:4], keys[0]) and torch.equal(value_buffer[0, :, 2:4], values[0])
    assert torch.equal(key_buffer[1, :, 0], keys[1, :, 0])
    assert torch.equal(key_buffer[1, :, 5], keys[1, :, 1])
    cache.advance([2, 1])
    assert cache.lengths == (4, 1) and cache.device_lengths[:2].tolist() == [4, 1]
    assert torch.equal(cache.continuation(1)[0], torch.tensor([[4], [1]]))
    rows_k, _ = cache.write(0, keys[:1, :, :1], values[:1, :, :1], torch.tensor([[1]]), rows=torch.tensor([1]))
    assert torch.equal(rows_k[0], key_buffer[1]) and torch.equal(key_buffer[1, :, 1], keys[0, :, 0])
    with pytest.raises(ValueError, match=r"holds 5 tokens per row; \(4, 1\) \+ \[2, 0\] does not fit"):
        cache.advance([2, 0])
    with pytest.raises(ValueError, match=r"new must hold one int per row \(2\), got 1"):
        cache.advance([1])
    assert cache.lengths == (4, 1)


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
        cache.write(0, k, v, p)

    _, (code,) = run_and_get_code(torch.compile(write, dynamic=False, fullgraph=True), keys, values, positions)
    bounds = [int(n) for n in re.findall(r"x\d+<static_cast<int64_t>\((\d+)L\)", code)]
    assert bounds and max(bounds) < capacity, bounds  # loops over (batch, heads, d_head), never the slots
    assert ".copy_(" not in code and "capacity" not in code
    assert torch.equal(cache.key_buffers[0][0, :, 3], keys[0, :, 0])
    assert torch.equal(cache.value_buffers[0][1, :, 7], values[1, :, 0])
    assert cache.key_buffers[0][0, :, 4:].abs().sum() == 0


def test_several_empty_rows_join_at_once():
    # Issue 41: generate's batch of thousands of rows joins in one go, not one host-side copy per row.
    cache = KVCache(5, 2, 8, 4)
    cache.select_rows([0])
    cache.advance([3])
    assert cache.append_empty_row(3) == 1 and cache.lengths == (3, 0, 0, 0)
    assert cache.device_lengths[:4].tolist() == [3, 0, 0, 0]
    with pytest.raises(ValueError, match=r"room for 5 rows; 4 in use \+ 2 new is too many"):
        cache.append_empty_row(2)


def test_write_with_a_limit_returns_only_the_first_slots_of_the_named_rows():
    # A grid forward names a buffer row per grid row: only the occupied prefix is gathered, never every slot.
    cache = KVCache(3, 2, capacity=8, d_head=4)
    keys = torch.randn(2, 2, 1, 4)
    got_k, got_v = cache.write(0, keys, -keys, torch.tensor([[2], [0]]), rows=torch.tensor([2, 0]), limit=3)
    assert got_k.shape == got_v.shape == (2, 2, 3, 4)
    assert torch.equal(got_k, cache.key_buffers[0][[2, 0], :, :3])
    assert torch.equal(got_k[0, :, 2], keys[0, :, 0]) and torch.equal(got_v[1, :, 0], -keys[1, :, 0])
    first, _ = cache.write(0, keys, -keys, torch.tensor([[1], [1]]), limit=2)  # the first rows, cut the same way
    assert first.shape == (2, 2, 2, 4) and torch.equal(first[1, :, 1], keys[1, :, 0])


def test_a_moved_row_copies_only_the_slots_that_hold_its_tokens():
    # A row that leaves early in a long-context batch costs a copy of the tokens moved, not of the capacity.
    cache = KVCache(3, 1, capacity=8, d_head=1)
    k = torch.arange(3 * 9, dtype=torch.float32).reshape(3, 1, 9, 1)
    _write(cache, 0, k, torch.arange(9).expand(3, 9))
    cache.advance([8, 1, 2])
    cache.select_rows([2, 1])  # row 0 leaves; row 2 (2 tokens) takes its place
    assert cache.lengths == (2, 1)
    assert torch.equal(cache.key_buffers[0][0, :, :2], k[2, :, :2])
    assert torch.equal(cache.value_buffers[0][0, :, :2], -k[2, :, :2])
    assert torch.equal(cache.key_buffers[0][0, :, 2:], k[0, :, 2:])  # nothing past its tokens was copied
    cache.select_rows([1, 0])  # a row of 1 token and one of 2 swap: the longer one's 2 slots, both ways
    assert torch.equal(cache.key_buffers[0][:2, :, :2], torch.stack([k[1, :, :2], k[2, :, :2]]))
