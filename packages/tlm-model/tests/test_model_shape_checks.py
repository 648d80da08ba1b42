"""The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import
hook with beartype) a wrong-shaped tensor is refused by the annotation itself."""

import torch

import tlm_model.block
from tlm_model import ModelConfig, TransformerBlock


def block_config(d_model, num_heads, d_ff, max_seq_len=16, theta=10_000.0, **fields):
    # One block's sizes as a ModelConfig; a block uses neither the vocabulary nor the depth.
    return ModelConfig(1, max_seq_len, d_model, 1, num_heads, d_ff, rope_theta=theta, **fields)


def test_positions_of_another_length_than_seq_are_refused_by_the_annotation(shape_checks):
    block = TransformerBlock(
        block_config(16, 2, 32, max_seq_len=8, theta=10_000.0)
    )  # d_model, num_heads, d_ff, max_seq_len, theta
    x, positions = torch.randn(1, 3, 16), torch.arange(5)  # x's seq is 3, positions' seq is 5
    shape_checks(tlm_model.block, lambda: block(x, positions))
