"""The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import
hook with beartype) a tensor of the wrong kind is refused by the annotation itself."""

import torch

import tlm_rope.rope
from tlm_rope import RotaryPositionalEmbedding


def test_floating_point_positions_are_refused_by_the_annotation(shape_checks):
    # The sequence axis moves with seq_dim, so forward's annotation names d_k only; positions must
    # still be an integer tensor (`Integer[Tensor, "..."]`).
    rope = RotaryPositionalEmbedding(10_000.0, 8, 16)
    x, positions = torch.randn(2, 3, 8), torch.arange(3.0)
    shape_checks(tlm_rope.rope, lambda: rope(x, positions))
