"""LoRA's read side: the adapters of a training checkpoint loaded by name into the model their settings build."""

import pytest
import torch

from tlm_artifacts.lora import is_adapter_key, load_named_adapters
from tlm_lora import apply_lora
from tlm_model import ModelConfig, TransformerLM


def test_adapters_that_do_not_fit_the_model_are_refused_and_nothing_is_loaded():
    def adapted(rank: int, targets: str = "q,v") -> TransformerLM:
        model = TransformerLM(ModelConfig(48, 16, 32, 1, 2, 64))
        apply_lora(model, targets, rank=rank)
        return model

    model = adapted(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fits = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items() if is_adapter_key(k)}
    other_rank = {k: v for k, v in adapted(4).state_dict().items() if is_adapter_key(k)}
    assert other_rank.keys() == fits.keys()  # the same names, other shapes
    more = {k: v for k, v in adapted(2, "q,v,o").state_dict().items() if is_adapter_key(k)}
    fewer = dict(list(fits.items())[:-1])
    for adapters in (other_rank, more, fewer):
        with pytest.raises(ValueError, match=r"^run/step_1: its adapters do not fit the model their settings build$"):
            load_named_adapters(model, adapters, "run/step_1")
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    load_named_adapters(model, fits, "run/step_1")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in fits.items())
