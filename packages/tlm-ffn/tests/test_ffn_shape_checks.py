"""The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import
hook with beartype) a wrong-shaped tensor is refused by the annotation itself."""

import torch

import tlm_ffn.swiglu
from tlm_ffn import SwiGLU


def test_a_tensor_without_the_model_axis_is_refused_by_the_annotation(shape_checks):
    ffn = SwiGLU(4, 8)
    shape_checks(tlm_ffn.swiglu, lambda: ffn(torch.tensor(1.0)))  # "... d_model" needs one axis at least
