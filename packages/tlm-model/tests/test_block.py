import pytest
import torch

from tlm_model import TransformerBlock
from tlm_rope import RotaryPositionalEmbedding


def randomized(block):
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight")):
                p.copy_(torch.rand_like(p) + 0.5)
    return block


def test_state_dict_keys(course_block_keys):
    block = TransformerBlock(16, 4, 48, 32, 10_000.0)
    assert set(block.state_dict()) == course_block_keys


@pytest.mark.parametrize("lead", [(), (3,)])
def test_matches_float64_rederivation(lead, device, block_reference):
    block = randomized(TransformerBlock(32, 4, 96, 64, 10_000.0, device=device))
    x = torch.randn(*lead, 12, 32, device=device)
    expected = block_reference(block.state_dict(), x, 4, 10_000.0)
    torch.testing.assert_close(block(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_token_positions_are_forwarded(block_reference):
    block = randomized(TransformerBlock(16, 2, 40, 64, 500.0))
    x = torch.randn(2, 5, 16)
    positions = torch.tensor([[3, 4, 5, 6, 7], [10, 20, 30, 40, 50]])
    expected = torch.stack([block_reference(block.state_dict(), x[b], 2, 500.0, positions[b]) for b in range(2)])
    torch.testing.assert_close(block(x, positions).double(), expected, rtol=1e-5, atol=1e-5)


def test_shared_rope_is_used():
    rope = RotaryPositionalEmbedding(10_000.0, 4, 16)
    block = TransformerBlock(16, 4, 32, rope=rope)
    assert block.attn.rope is rope


@pytest.mark.parametrize("sizes", [dict(max_seq_len=16), dict(theta=500.0), dict(max_seq_len=32, theta=500.0)])
def test_rope_together_with_its_sizes_is_refused(sizes):
    # The rope's own table would silently win over max_seq_len/theta: one source of truth.
    with pytest.raises(ValueError, match="either rope or max_seq_len and theta, not both"):
        TransformerBlock(16, 4, 32, rope=RotaryPositionalEmbedding(10_000.0, 4, 16), **sizes)


@pytest.mark.parametrize("sizes", [dict(), dict(max_seq_len=16), dict(theta=500.0)])
def test_without_rope_both_sizes_are_required(sizes):
    with pytest.raises(ValueError, match="needs either max_seq_len and theta"):
        TransformerBlock(16, 4, 32, **sizes)


def test_block_builds_its_rope_from_its_sizes():
    block = TransformerBlock(16, 4, 32, 24, 500.0)
    rope = block.attn.rope
    assert isinstance(rope, RotaryPositionalEmbedding)
    assert (rope.theta, rope.d_k, rope.max_seq_len) == (500.0, 4, 24)


def test_bad_arguments():
    with pytest.raises(ValueError, match="d_model must be divisible by num_heads"):
        TransformerBlock(30, 4, 64, 16, 10_000.0)
    with pytest.raises(ValueError, match="d_k must be even"):
        TransformerBlock(12, 4, 64, 16, 10_000.0)
    with pytest.raises(ValueError, match="theta must be a finite number > 0"):
        TransformerBlock(16, 4, 64, 16, 0.0)
