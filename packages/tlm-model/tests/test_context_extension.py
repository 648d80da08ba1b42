"""A context extended by RoPE scaling (what ``tlm train --init-from --context-length --rope-scaling`` builds),
exported with save_hf: transformers reads the same scaling and computes the same logits at every position,
those past the original context included (HF's own RoPE scaling as the reference)."""

import json

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM, from_hf, save_hf
from tlm_rope import extension_scaling

transformers = pytest.importorskip("transformers")

ORIGINAL, EXTENDED = 16, 64


def extended_model(rule):
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=128, context_length=EXTENDED, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=96,
        rope_scaling=extension_scaling(rule, ORIGINAL, EXTENDED),
    )  # fmt: skip
    model = TransformerLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("rule", ["linear", "dynamic", "yarn", "llama3"])
def test_an_extended_context_exports_with_its_scaling_and_hf_matches_past_the_original(rule, tmp_path, record_error):
    model = extended_model(rule)
    assert model.config.rope_scaling["factor"] == EXTENDED / ORIGINAL
    save_hf(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    assert written["rope_type"] == rule and written["factor"] == 4.0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 128, (2, EXTENDED))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    record_error(f"extended context ({rule}, {ORIGINAL} -> {EXTENDED}) vs HF's own RoPE scaling", ours, theirs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # The positions past the original context are where the rule acts: unscaled, they differ.
    plain = TransformerLM(ModelConfig.from_dict({**model.config.to_dict(), "rope_scaling": None})).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (plain(ids)[:, ORIGINAL:] - theirs[:, ORIGINAL:]).abs().max() > 1e-3
    # And the export reads back as the same model (dynamic's context, which HF grows by itself, given).
    again = from_hf(tmp_path, context_length=EXTENDED)
    assert again.config == model.config


def test_dynamic_exports_its_original_context_as_hf_reads_it(tmp_path):
    # transformers' dynamic NTK takes max_position_embeddings as the original context and grows past it.
    save_hf(extended_model("dynamic"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["max_position_embeddings"] == ORIGINAL
    assert from_hf(tmp_path).config.context_length == ORIGINAL
    config["rope_parameters"]["original_max_position_embeddings"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="original_max_position_embeddings=8 differs from max_position_embeddings=16"):
        from_hf(tmp_path)
