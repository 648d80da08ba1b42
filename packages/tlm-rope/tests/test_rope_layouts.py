"""layout="half", seq_dim=-3 and partial rotary, against the complex-multiplication reference."""

import pytest
import torch

from tlm_rope import RotaryPositionalEmbedding


def half_to_interleaved(d):
    # Feature k of the first half pairs with k + d/2: interleaving them makes pair (2k, 2k+1).
    return torch.stack([torch.arange(d // 2), torch.arange(d // 2, d)], dim=-1).flatten()


def test_half_layout_is_interleaved_rope_on_permuted_features(rope_reference, record_error):
    d, theta = 16, 10_000.0
    rope = RotaryPositionalEmbedding(theta, d, 32, layout="half")
    x = torch.randn(2, 3, 9, d, dtype=torch.float64)
    positions = torch.randint(0, 32, (2, 1, 9))
    order = half_to_interleaved(d)
    expected = rope_reference(x[..., order], positions, theta)[..., torch.argsort(order)]
    got = rope(x, positions)
    record_error("rope layout=half vs complex reference (float64 x)", got, expected)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_half_layout_matches_hf_apply_rotary_pos_emb():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=64, rope_parameters={"rope_theta": 5e4}
    )
    q, k = torch.randn(2, 2, 4, 10, 32)
    positions = torch.arange(3, 13).expand(2, 10)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    rope = RotaryPositionalEmbedding(5e4, 32, 64, layout="half")
    torch.testing.assert_close(rope(q, positions.unsqueeze(1)), q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope(k, positions.unsqueeze(1)), k_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_seq_dim_minus_3_rotates_by_position_not_head(layout):
    # (batch, seq, heads, d): the torchtune/flash-attn layout. Every head at a position gets the
    # same rotation as the (batch, heads, seq, d) layout gives it.
    torch.manual_seed(0)
    bshd = RotaryPositionalEmbedding(10_000.0, 8, 32, layout=layout, seq_dim=-3)
    bhsd = RotaryPositionalEmbedding(10_000.0, 8, 32, layout=layout)
    x = torch.randn(2, 7, 3, 8)
    expected = bhsd(x.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(bshd(x), expected, rtol=0, atol=0)
    positions = torch.randint(0, 32, (2, 7))
    expected = bhsd(x.transpose(1, 2), positions.unsqueeze(1)).transpose(1, 2)
    torch.testing.assert_close(bshd(x, positions), expected, rtol=0, atol=0)


def test_seq_dim_is_checked():
    with pytest.raises(ValueError, match=r"seq_dim must be -2 .* or -3 .*, got 1"):
        RotaryPositionalEmbedding(10_000.0, 8, 32, seq_dim=1)
    rope = RotaryPositionalEmbedding(10_000.0, 8, 32, seq_dim=-3)
    with pytest.raises(ValueError, match=r"\(\.\.\., seq, heads, d_k=8\), got \(5, 8\)"):
        rope(torch.randn(5, 8))
    with pytest.raises(ValueError, match="must broadcast"):
        rope(torch.randn(2, 5, 3, 8), torch.arange(3))  # positions of the heads axis: refused


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_partial_rotary_rotates_the_first_rotary_dim_features_only(layout, rope_reference):
    rope = RotaryPositionalEmbedding(10_000.0, 16, 32, layout=layout, rotary_dim=6)
    full = RotaryPositionalEmbedding(10_000.0, 6, 32, layout=layout)
    x = torch.randn(3, 11, 16, dtype=torch.float64)
    got = rope(x)
    torch.testing.assert_close(got[..., :6], full(x[..., :6]), rtol=0, atol=0)
    torch.testing.assert_close(got[..., 6:], x[..., 6:], rtol=0, atol=0)
    if layout == "interleaved":
        torch.testing.assert_close(
            got[..., :6], rope_reference(x[..., :6], torch.arange(11), 10_000.0), rtol=1e-6, atol=1e-6
        )


@pytest.mark.parametrize(("rotary_dim", "match"), [(5, "even"), (18, "at most d_k=16"), (0, "positive")])
def test_bad_rotary_dim(rotary_dim, match):
    with pytest.raises(ValueError, match=match):
        RotaryPositionalEmbedding(10_000.0, 16, 32, rotary_dim=rotary_dim)


def test_bad_layout():
    with pytest.raises(ValueError, match=r"layout must be one of \('interleaved', 'half'\), got 'neox'"):
        RotaryPositionalEmbedding(10_000.0, 16, 32, layout="neox")


def test_past_max_seq_len_is_a_clear_error():
    rope = RotaryPositionalEmbedding(10_000.0, 8, 16)
    with pytest.raises(ValueError, match=r"max_seq_len=16"):
        rope(torch.randn(17, 8))
    with pytest.raises(ValueError, match=r"token_positions must lie in \[0, max_seq_len=16\)"):
        rope(torch.randn(2, 8), torch.tensor([3, 16]))
