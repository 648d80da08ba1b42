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
