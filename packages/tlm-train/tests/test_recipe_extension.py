"""extended_config (tlm_train.recipe): a context extension asks for a RoPE rule, so an --init-from model without
RoPE (positions='none') is refused by name, before any rule is completed against it."""

import pytest

from tlm_model import ModelConfig
from tlm_train import TrainConfig
from tlm_train.recipe import extended_config


def test_a_model_without_rope_has_no_rope_to_scale():
    shape = ModelConfig(vocab_size=32, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64,
                        positions="none")  # fmt: skip
    config = TrainConfig(init_from="base", model={"context_length": 32, "rope_scaling": "linear"})
    with pytest.raises(ValueError, match=r"^--rope-scaling: the --init-from model has no RoPE to scale"):
        extended_config(shape, config)
    longer = extended_config(shape, TrainConfig(init_from="base", model={"context_length": 32}))
    assert (longer.context_length, longer.positions, longer.rope_scaling) == (32, "none", None)  # no rule: no scaling


def test_a_rule_is_never_stacked_on_a_model_whose_rope_is_already_scaled():
    shape = ModelConfig(vocab_size=32, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64,
                        rope_scaling={"rope_type": "linear", "factor": 2.0})  # fmt: skip
    config = TrainConfig(init_from="base", model={"context_length": 64, "rope_scaling": "yarn"})
    with pytest.raises(ValueError, match=r"^--rope-scaling 'yarn': the --init-from model's RoPE is already scaled"):
        extended_config(shape, config)
