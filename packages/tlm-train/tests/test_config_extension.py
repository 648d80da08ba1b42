"""TrainConfig's context-extension rules (tlm_train.config), checked when the config is made: a RoPE rule by name
and --rope-factor extend an --init-from model's context, so without --init-from they are refused, and a partial
scaling table (completed only against an --init-from model) is refused as ModelConfig refuses it."""

import pytest

from tlm_model import ModelConfig
from tlm_train import TrainConfig


@pytest.mark.parametrize(("fields", "message"), [
    ({"rope_factor": 2.0}, r"^TrainConfig.rope_factor goes with TrainConfig.init_from and a rope_scaling rule"),
    ({"model": {"rope_scaling": "yarn"}}, r"^TrainConfig.model.rope_scaling 'yarn' names a rule, which extends"),
])  # fmt: skip
def test_a_context_extension_without_init_from_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**fields)


def test_a_partial_scaling_table_without_init_from_is_refused_as_model_config_refuses_it():
    table = {"rope_type": "linear"}  # no factor
    with pytest.raises(ValueError) as reference:
        ModelConfig(vocab_size=32, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64,
                    rope_scaling=table)  # fmt: skip
    with pytest.raises(ValueError) as caught:
        TrainConfig(model={"rope_scaling": table})
    assert str(caught.value) == f"TrainConfig.model: {reference.value}"


@pytest.mark.parametrize("factor", [1.0, 1.5, 0.5])
def test_rope_factor_is_bounded_as_tlm_rope_bounds_a_scaling_factor(factor):
    # tlm_rope owns the rule: a factor of 1 (no scaling) and up are a scaling it completes, below 1 it refuses;
    # TrainConfig accepts and refuses the same factors, before any model is read.
    from tlm_rope.options import extension_scaling

    try:
        extension_scaling("linear", 16, 32, factor=factor)
    except ValueError as err:
        assert "must be a finite number >= 1" in str(err)
        with pytest.raises(ValueError, match=rf"^TrainConfig.rope_factor must be a finite number >= 1, got {factor}"):
            TrainConfig(init_from="run", model={"rope_scaling": "linear"}, rope_factor=factor)
    else:
        config = TrainConfig(init_from="run", model={"rope_scaling": "linear"}, rope_factor=factor)
        assert config.rope_factor == factor
