"""The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import
hook with beartype) a wrong-shaped tensor is refused by the annotation itself."""

import torch

import tlm_rope.rope
from tlm_rope import RotaryPositionalEmbedding


def test_positions_of_another_length_than_seq_are_refused_by_the_annotation(shape_checks):
    rope = RotaryPositionalEmbedding(10_000.0, 8, 16)
    x, positions = torch.randn(2, 3, 8), torch.arange(5)  # x's seq is 3, positions' seq is 5
    shape_checks(tlm_rope.rope, lambda: rope(x, positions))
