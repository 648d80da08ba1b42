"""TransformerBlock wiring that a mutation run found unpinned: dtype reaches every submodule."""

import pytest
import torch

from tlm_model import ModelConfig, TransformerBlock


def block_config(d_model, num_heads, d_ff, max_seq_len=16, theta=10_000.0, **fields):
    # One block's sizes as a ModelConfig; a block uses neither the vocabulary nor the depth.
    return ModelConfig(1, max_seq_len, d_model, 1, num_heads, d_ff, rope_theta=theta, **fields)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_reaches_every_parameter(dtype, fused):
    block = TransformerBlock(block_config(16, 2, 24, max_seq_len=8), dtype=dtype, fused=fused)
    assert {p.dtype for p in block.parameters()} == {dtype}
    x = torch.randn(1, 5, 16, dtype=dtype)
    assert block(x).dtype == dtype
