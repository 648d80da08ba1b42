"""The jaxtyping annotations are checked, not decoration: under `nox -s tests` (jaxtyping's import
hook with beartype) a wrong-shaped tensor is refused by the annotation itself."""

import torch

import tlm_attention.sdpa
from tlm_attention import scaled_dot_product_attention


def test_queries_and_keys_of_different_d_k_are_refused_by_the_annotation(shape_checks):
    q, k, v = torch.randn(3, 4), torch.randn(5, 6), torch.randn(5, 2)  # d_k: 4 in Q, 6 in K
    shape_checks(tlm_attention.sdpa, lambda: scaled_dot_product_attention(q, k, v))
