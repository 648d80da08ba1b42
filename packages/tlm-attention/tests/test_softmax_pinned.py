"""softmax and SDPA edges that a mutation run found unpinned: 0-d and 1-d inputs, non-tensors."""

import pytest
import torch

from tlm_attention import scaled_dot_product_attention, softmax


@pytest.mark.parametrize("dim", [0, -1])
def test_zero_dimensional_input_matches_torch(dim):
    x = torch.tensor(3.5)
    torch.testing.assert_close(softmax(x, dim), torch.softmax(x, dim))


def test_one_dimensional_input_refuses_dim_one():
    with pytest.raises(ValueError, match=r"dim must be in \[-1, 0\] for a tensor of rank 1, got 1"):
        softmax(torch.randn(4), 1)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_sdpa_refuses_a_non_tensor_with_a_type_error(which):
    args = [torch.randn(2, 4), torch.randn(3, 4), torch.randn(3, 4)]
    args[which] = args[which].tolist()
    with pytest.raises(TypeError, match=f"{'QKV'[which]} must be a torch.Tensor, got list"):
        scaled_dot_product_attention(*args)
