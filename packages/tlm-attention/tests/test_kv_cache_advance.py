"""KVCache.advance refuses a negative count even where the row's length would stay non-negative (a row's length
only grows by advance; truncate shortens one), and a continuation with no rows in use starts at slot 0."""

import pytest

from tlm_attention import KVCache


@pytest.mark.parametrize("new", [[-1, 0], [0, -1], [-2, 1]])
def test_advance_refuses_a_negative_count_and_changes_nothing(new):
    cache = KVCache(2, 2, capacity=8, d_head=4)
    cache.advance([3, 3])
    with pytest.raises(ValueError, match=rf"holds 8 tokens per row; \(3, 3\) \+ \[{new[0]}, {new[1]}\] does not fit"):
        cache.advance(new)
    assert cache.lengths == (3, 3) and cache.device_lengths[:2].tolist() == [3, 3]


def test_with_no_rows_in_use_a_continuation_reads_the_new_slots_from_zero_up_to_the_capacity():
    cache = KVCache(2, 2, capacity=8, d_head=4)
    cache.select_rows([])
    positions, steps = cache.continuation(3)
    assert positions.shape == (0, 3) and steps.tolist() == [0, 1, 2]
    assert cache.continuation(8)[1].tolist() == list(range(8))
    with pytest.raises(ValueError, match=r"^the KV cache holds 8 tokens; 0 stored \+ 9 new is too many$"):
        cache.continuation(9)
