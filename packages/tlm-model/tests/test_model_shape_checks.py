"""The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import
hook with beartype) a wrong-shaped tensor is refused by the annotation itself."""

import torch

import tlm_model.block
from tlm_model import TransformerBlock


def test_positions_of_another_length_than_seq_are_refused_by_the_annotation(shape_checks):
    block = TransformerBlock(16, 2, 32, 8, 10_000.0)  # d_model, num_heads, d_ff, max_seq_len, theta
    x, positions = torch.randn(1, 3, 16), torch.arange(5)  # x's seq is 3, positions' seq is 5
    shape_checks(tlm_model.block, lambda: block(x, positions))
