import math
import pickle

import pytest
import torch
from torch import nn

from tlm_linear import Linear, register_split_layout, split_layout


class Stacked(nn.Module):
    """Two projections a (3 rows) and b (2 rows) stored as one fused (5, 4) weight."""

    def __init__(self):
        super().__init__()
        self.ab = Linear(4, 5)
        register_split_layout(self, "ab", {"a": 3, "b": 2})


def test_state_dict_shows_the_split_layout():
    module = Stacked()
    sd = module.state_dict()
    assert set(sd) == {"a.weight", "b.weight"}
    torch.testing.assert_close(torch.cat([sd["a.weight"], sd["b.weight"]]), module.ab.weight, rtol=0, atol=0)
    # The blocks own their storage (savers such as safetensors reject shared tensors).
    assert sd["a.weight"].untyped_storage().data_ptr() != module.ab.weight.untyped_storage().data_ptr()


def test_split_and_fused_keys_both_load():
    source, target = Stacked(), Stacked()
    target.load_state_dict(source.state_dict())
    torch.testing.assert_close(target.ab.weight, source.ab.weight, rtol=0, atol=0)
    target2 = Stacked()
    target2.load_state_dict({"ab.weight": source.ab.weight.detach().clone()})
    torch.testing.assert_close(target2.ab.weight, source.ab.weight, rtol=0, atol=0)


def test_split_layout_nested_under_a_prefix():
    outer = nn.ModuleDict({"inner": Stacked()})
    assert set(outer.state_dict()) == {"inner.a.weight", "inner.b.weight"}
    other = nn.ModuleDict({"inner": Stacked()})
    other.load_state_dict(outer.state_dict())
    torch.testing.assert_close(other["inner"].ab.weight, outer["inner"].ab.weight, rtol=0, atol=0)


def test_missing_part_is_reported_by_load_state_dict():
    sd = Stacked().state_dict()
    del sd["b.weight"]
    with pytest.raises(RuntimeError, match="Missing key"):
        Stacked().load_state_dict(sd)


def test_init_std_override():
    layer = Linear(512, 1536, init_std=math.sqrt(1 / 512))
    w = layer.weight.detach().double()
    assert layer.init_std == pytest.approx(math.sqrt(1 / 512))
    assert w.abs().max().item() <= 3 * layer.init_std
    # std of N(0, σ²) truncated at ±3σ is 0.98658 σ.
    assert w.std().item() == pytest.approx(0.98658 * layer.init_std, rel=0.02)
    with pytest.raises(ValueError, match="init_std must be a finite number > 0, got -1.0"):
        Linear(4, 4, init_std=-1.0)


def test_a_module_with_the_layout_pickles_and_saves_whole():
    # The hooks are objects of importable classes, not closures, so pickle and torch.save take them.
    import io
    import pickle

    module = nn.Module()
    module.ab = Linear(4, 5)
    register_split_layout(module, "ab", {"a": 3, "b": 2})
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    for copy in (pickle.loads(pickle.dumps(module)), torch.load(buffer, weights_only=False)):
        sd = copy.state_dict()
        assert set(sd) == {"a.weight", "b.weight"}
        torch.testing.assert_close(torch.cat([sd["a.weight"], sd["b.weight"]]), module.ab.weight, rtol=0, atol=0)
        copy.load_state_dict({"a.weight": torch.zeros(3, 4), "b.weight": torch.ones(2, 4)})
        assert torch.equal(copy.ab.weight, torch.cat([torch.zeros(3, 4), torch.ones(2, 4)]))


def test_a_fused_key_present_beside_the_parts_wins_and_the_parts_are_unexpected():
    module = Stacked()
    fused = torch.randn(5, 4)
    state = {"ab.weight": fused, "a.weight": torch.zeros(3, 4), "b.weight": torch.zeros(2, 4)}
    with pytest.raises(RuntimeError, match="Unexpected key"):
        module.load_state_dict(state)
    result = module.load_state_dict(state, strict=False)
    assert set(result.unexpected_keys) == {"a.weight", "b.weight"}
    assert torch.equal(module.ab.weight, fused)


def test_split_layout_reports_the_registered_parts_and_survives_a_pickle():
    module = Stacked()
    assert split_layout(module, "ab") == {"a": 3, "b": 2}
    assert split_layout(module, "a") is None
    assert split_layout(pickle.loads(pickle.dumps(module)), "ab") == {"a": 3, "b": 2}
    split_layout(module, "ab")["a"] = 99  # a copy: the record is not changed through it
    assert split_layout(module, "ab") == {"a": 3, "b": 2}
