"""RoPE edges that a mutation run found unpinned."""

import torch

from tlm_rope import RotaryPositionalEmbedding


def test_empty_positions_with_an_empty_sequence_give_an_empty_result():
    rope = RotaryPositionalEmbedding(10_000.0, 4, 8)
    x = torch.randn(2, 0, 4)
    out = rope(x, torch.zeros(0, dtype=torch.long))
    assert out.shape == (2, 0, 4)
