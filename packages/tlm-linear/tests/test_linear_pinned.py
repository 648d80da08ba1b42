"""Linear and split-layout edges that a mutation run found unpinned."""

import pytest
import torch
import torch.nn.functional as F

from tlm_linear import Linear, register_split_layout


def test_one_by_one_layer_is_valid():
    layer = Linear(1, 1)
    x = torch.randn(3, 1)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, float("inf"), float("nan")])
def test_init_std_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="init_std must be a finite number > 0 or None"):
        Linear(2, 2, init_std=bad)


class _Fused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ab = Linear(3, 4)
        register_split_layout(self, "ab", {"a": 2, "b": 2})


def test_a_fused_key_present_beside_the_parts_wins_and_the_parts_are_unexpected():
    module = _Fused()
    fused = torch.randn(4, 3)
    state = {"ab.weight": fused, "a.weight": torch.zeros(2, 3), "b.weight": torch.zeros(2, 3)}
    with pytest.raises(RuntimeError, match="Unexpected key"):
        module.load_state_dict(state)
    result = module.load_state_dict(state, strict=False)
    assert set(result.unexpected_keys) == {"a.weight", "b.weight"}
    assert torch.equal(module.ab.weight, fused)
