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
    block = TransformerBlock(16, 4, 32, 16, 10_000.0, rope=rope)
    assert block.attn.rope is rope


def test_bad_arguments():
    with pytest.raises(ValueError, match="d_model must be divisible by num_heads"):
        TransformerBlock(30, 4, 64, 16, 10_000.0)
    with pytest.raises(ValueError, match="d_k must be even"):
        TransformerBlock(12, 4, 64, 16, 10_000.0)
    with pytest.raises(ValueError, match="theta must be a finite number > 0"):
        TransformerBlock(16, 4, 64, 16, 0.0)
