"""load_base (tlm_artifacts.artifact): a LoRA run's base is loaded in float32, as its docstring says, whatever dtype
its file holds: the adapters are merged into float32 weights."""

import torch

from tlm_artifacts.artifact import load_base
from tlm_model import save_model_file


def test_a_base_saved_in_bfloat16_is_loaded_in_float32_with_the_same_values(tmp_path, writers):
    model = writers.model(2).to(torch.bfloat16)
    save_model_file(model, tmp_path / "base")
    loaded = load_base(str(tmp_path / "base"), expect_sha256=None, what="run r")
    saved = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, saved[name].float()), name  # bfloat16 -> float32 is exact
