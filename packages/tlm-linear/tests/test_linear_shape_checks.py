"""The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import
hook with beartype) a wrong-shaped tensor is refused by the annotation itself."""

import torch

import tlm_linear.linear
from tlm_linear import Linear


def test_a_tensor_without_the_feature_axis_is_refused_by_the_annotation(shape_checks):
    layer = Linear(4, 3)
    shape_checks(tlm_linear.linear, lambda: layer(torch.tensor(1.0)))  # "... d_in" needs one axis at least
