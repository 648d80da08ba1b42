import pytest
import torch

from tlm_model import ModelConfig, TransformerBlock
from tlm_rope import RotaryPositionalEmbedding


def block_config(d_model, num_heads, d_ff, max_seq_len=16, theta=10_000.0, **fields):
    # One block's sizes as a ModelConfig; a block uses neither the vocabulary nor the depth.
    return ModelConfig(1, max_seq_len, d_model, 1, num_heads, d_ff, rope_theta=theta, **fields)


def randomized(block):
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight")):
                p.copy_(torch.rand_like(p) + 0.5)
    return block


def test_state_dict_keys(course_block_keys):
    block = TransformerBlock(block_config(16, 4, 48, max_seq_len=32))
    assert set(block.state_dict()) == course_block_keys


@pytest.mark.parametrize("lead", [(), (3,)])
def test_matches_float64_rederivation(lead, device, block_reference):
    block = randomized(TransformerBlock(block_config(32, 4, 96, max_seq_len=64), device=device))
    x = torch.randn(*lead, 12, 32, device=device)
    expected = block_reference(block.state_dict(), x, 4, 10_000.0)
    torch.testing.assert_close(block(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_token_positions_are_forwarded(block_reference):
    block = randomized(TransformerBlock(block_config(16, 2, 40, max_seq_len=64, theta=500.0)))
    x = torch.randn(2, 5, 16)
    positions = torch.tensor([[3, 4, 5, 6, 7], [10, 20, 30, 40, 50]])
    expected = torch.stack([block_reference(block.state_dict(), x[b], 2, 500.0, positions[b]) for b in range(2)])
    torch.testing.assert_close(block(x, positions).double(), expected, rtol=1e-5, atol=1e-5)


def test_shared_rope_is_used():
    rope = RotaryPositionalEmbedding(10_000.0, 4, 16)
    block = TransformerBlock(block_config(16, 4, 32), rope=rope)
    assert block.attn.rope is rope


def test_block_builds_its_rope_from_its_config():
    block = TransformerBlock(block_config(16, 4, 32, max_seq_len=24, theta=500.0, rope_layout="half"))
    rope = block.attn.rope
    assert isinstance(rope, RotaryPositionalEmbedding)
    assert (rope.theta, rope.d_k, rope.max_seq_len, rope.layout) == (500.0, 4, 24, "half")


def test_block_config_fields_reach_the_modules():
    config = block_config(24, 6, 40, norm_eps=1e-3, num_kv_heads=2, head_dim=6)
    block = TransformerBlock(config, fused=False)
    assert (block.attn.num_heads, block.attn.num_kv_heads, block.attn.d_head) == (6, 2, 6)
    assert block.ln1.eps == block.ln2.eps == 1e-3
    assert tuple(block.ffn.w1.weight.shape) == (40, 24)


# The ablations of CS336 §7, one field each, against the float64 formula of each block (conftest.reference_block).
ABLATIONS = [dict(norm_placement="post"), dict(norm_placement="none"), dict(positions="none"), dict(ffn="silu")]


@pytest.mark.parametrize("fields", ABLATIONS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_ablation_blocks_match_float64_rederivation(fields, device, block_reference, course_block_keys):
    config = block_config(32, 4, 96, max_seq_len=64, **fields)
    block = randomized(TransformerBlock(config, device=device))
    absent = {
        "norm_placement": {"ln1.weight", "ln2.weight"} if config.norm_placement == "none" else set(),
        "ffn": {"ffn.w3.weight"} if config.ffn == "silu" else set(),
    }
    assert set(block.state_dict()) == course_block_keys - set().union(*absent.values())
    assert (block.attn.rope is None) == (config.positions == "none")
    x = torch.randn(3, 12, 32, device=device)
    variant = dict(norm_placement=config.norm_placement, rope=config.positions == "rope", ffn=config.ffn)
    expected = block_reference(block.state_dict(), x, 4, 10_000.0, **variant)
    torch.testing.assert_close(block(x).double(), expected, rtol=1e-5, atol=1e-5)  # as the pre-norm test above
    if config.norm_placement == "post":
        # The placement is what is tested: the same weights read as pre-norm give another function.
        assert (block_reference(block.state_dict(), x, 4, 10_000.0) - expected).abs().max() > 1e-2


def test_a_rope_module_for_a_nope_block_is_refused():
    with pytest.raises(ValueError, match="rope was given but config.positions is 'none'"):
        TransformerBlock(block_config(16, 4, 32, positions="none"), rope=RotaryPositionalEmbedding(10_000.0, 4, 16))


# ---- TransformerBlock wiring that a mutation run found unpinned: dtype reaches every submodule.


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_reaches_every_parameter(dtype, fused):
    block = TransformerBlock(block_config(16, 2, 24, max_seq_len=8), dtype=dtype, fused=fused)
    assert {p.dtype for p in block.parameters()} == {dtype}
    x = torch.randn(1, 5, 16, dtype=dtype)
    assert block(x).dtype == dtype


def test_norm_eps_reaches_every_norm_of_the_block(block_reference):
    block = randomized(TransformerBlock(block_config(32, 4, 48, norm_eps=1.5))).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        got = block(x)
    expected = block_reference(block.state_dict(), x, 4, 10_000.0, eps=1.5)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # float32 RoPE tables, as above
    assert (block_reference(block.state_dict(), x, 4, 10_000.0) - got).abs().max() > 1e-3
