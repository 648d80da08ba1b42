"""RMSNorm edges that a mutation run found unpinned: bool sizes, eps at its bounds, 0-d input."""

import pytest
import torch
import torch.nn.functional as F

from tlm_norm import RMSNorm


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(d_model=True), TypeError, "d_model must be an int, got bool"),
        (dict(d_model=-3), ValueError, "d_model must be positive, got -3"),
        (dict(d_model=8, eps=True), TypeError, "eps must be a float, got bool"),
        (dict(d_model=8, eps=float("inf")), ValueError, "eps must be a finite number >= 0, got inf"),
    ],
)
def test_more_bad_constructor_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        RMSNorm(**kwargs)


@pytest.mark.parametrize("eps", [0, 0.0, 1e-30, 3])
def test_eps_at_and_near_zero_is_accepted_and_used(eps):
    norm = RMSNorm(6, eps=eps)
    assert norm.eps == float(eps) and isinstance(norm.eps, float)
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(norm.double()(x), F.rms_norm(x, (6,), eps=float(eps)))


def test_zero_dimensional_input_is_a_value_error():
    with pytest.raises(ValueError, match=r"x must have last dimension d_model=1, got shape \(\)"):
        RMSNorm(1)(torch.tensor(2.0))


def test_one_element_rows_normalise_to_the_sign():
    x = torch.tensor([[3.0], [-0.5]], dtype=torch.float64)
    torch.testing.assert_close(RMSNorm(1, eps=0.0).double()(x), torch.sign(x))
