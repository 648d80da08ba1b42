"""TransformerBlock wiring that a mutation run found unpinned: dtype reaches every submodule."""

import pytest
import torch

from tlm_model import TransformerBlock


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_reaches_every_parameter(dtype, fused):
    block = TransformerBlock(16, 2, 24, 8, 10_000.0, dtype=dtype, fused=fused)
    assert {p.dtype for p in block.parameters()} == {dtype}
    x = torch.randn(1, 5, 16, dtype=dtype)
    assert block(x).dtype == dtype
