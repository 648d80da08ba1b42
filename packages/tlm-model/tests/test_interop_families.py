"""from_hf / save_hf for the families beside Llama: Qwen2 (biases on q, k and v) and Mistral (a sliding window),
against transformers' own Qwen2ForCausalLM and MistralForCausalLM built from random tiny configs (no download).

Every parameter is drawn at random (the biases and the RMSNorm weights included, which HF initialises to 0 and
1), so a bias that is dropped, mis-ordered or left unrotated shows in the logits.
"""

import json

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM, from_hf, save_hf
from tlm_model.interop import config_from_hf, hf_llama_config_kwargs, hf_qwen2_config_kwargs

transformers = pytest.importorskip("transformers")

VOCAB = 256


def randomize(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def qwen2(tie=False, **overrides):
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, **overrides,
    )  # fmt: skip
    return randomize(transformers.Qwen2ForCausalLM(config))


def mistral(sliding_window, max_position_embeddings=64):
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=max_position_embeddings,
        sliding_window=sliding_window, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )  # fmt: skip
    return randomize(transformers.MistralForCausalLM(config))


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_qwen2_imports_with_its_biases_and_matches_transformers(tie, fused, tmp_path, record_error):
    hf = qwen2(tie)
    hf.save_pretrained(tmp_path)
    assert any(name.endswith("q_proj.bias") for name, _ in hf.named_parameters())
    model = from_hf(tmp_path, fused=fused)
    assert model.config.qkv_bias and model.config.tie_word_embeddings == tie
    assert model.config.kv_heads == 2 and model.config.rope_theta == 1_000_000.0
    ids = torch.randint(0, VOCAB, (2, 64))
    got, ref = logits(model, ids), logits(hf, ids)
    record_error("from_hf logits vs transformers, Qwen2 (q/k/v biases)", got, ref)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # Without the biases the logits are far off: the test sees them.
    unbiased = TransformerLM(ModelConfig.from_dict({**model.config.to_dict(), "qkv_bias": False}))
    unbiased.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith(".bias")})
    assert (logits(unbiased, ids) - ref).abs().max() > 1e-2


def test_qwen2_exports_as_qwen2_and_transformers_reads_the_same_logits(tmp_path, record_error):
    hf = qwen2()
    hf.save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    save_hf(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == "Qwen2ForCausalLM"
    ids = torch.randint(0, VOCAB, (2, 40))
    record_error("save_hf -> from_pretrained logits vs transformers, Qwen2", logits(back, ids), logits(hf, ids))
    torch.testing.assert_close(logits(back, ids), logits(hf, ids), rtol=0, atol=0)  # HF's weights exactly
    again = from_hf(tmp_path / "out")
    assert again.config == model.config
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_biased_model_trained_in_tlm_exports_as_qwen2(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, context_length=32, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                         qkv_bias=True)  # fmt: skip
    model = randomize(TransformerLM(config))
    assert all(layer.attn.qkv_bias.abs().min() > 0 for layer in model.layers)
    save_hf(model, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (1, 32))
    torch.testing.assert_close(logits(back, ids), logits(model, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="an HF Llama cannot express ModelConfig.qkv_bias=True"):
        hf_llama_config_kwargs(config)
    with pytest.raises(ValueError, match="qkv_bias must be True to export as Qwen2"):
        hf_qwen2_config_kwargs(ModelConfig.from_dict({**config.to_dict(), "qkv_bias": False}))


@pytest.mark.parametrize("window", [None, 64, 200])
def test_mistral_within_its_window_imports_and_matches_transformers(window, tmp_path, record_error):
    # No window, or one that holds the whole context (64 positions): full causal attention.
    hf = mistral(window)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert model.config.context_length == 64 and not model.config.qkv_bias
    ids = torch.randint(0, VOCAB, (2, 64))
    got, ref = logits(model, ids), logits(hf, ids)
    record_error("from_hf logits vs transformers, Mistral (context within the window)", got, ref)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_mistral_beyond_its_window_is_refused_in_one_line_and_imports_within_it(tmp_path, record_error):
    hf = mistral(sliding_window=16, max_position_embeddings=64)
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        from_hf(tmp_path)
    message = str(err.value)
    assert "\n" not in message and "sliding_window=16 is shorter than the context of 64 tokens" in message
    assert "--context-length 16" in message
    model = from_hf(tmp_path, context_length=16)
    assert model.config.context_length == 16
    ids = torch.randint(0, VOCAB, (2, 16))
    got, ref = logits(model, ids), logits(hf, ids)
    record_error("from_hf logits vs transformers, Mistral (context = its window)", got, ref)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # The refusal is needed: one token past the window, HF's sliding attention is no longer full attention.
    longer = TransformerLM(ModelConfig.from_dict({**model.config.to_dict(), "context_length": 17}))
    longer.load_state_dict(model.state_dict())
    ids = torch.randint(0, VOCAB, (1, 17))
    assert (logits(longer, ids)[:, -1] - logits(hf, ids)[:, -1]).abs().max() > 1e-4
    # And a Mistral imported within its window exports as a Llama that transformers reads the same.
    save_hf(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    torch.testing.assert_close(logits(back, ids), logits(hf, ids), rtol=0, atol=0)
    with pytest.raises(ValueError, match="context_length must be at most the checkpoint's max_position_embeddings=64"):
        from_hf(tmp_path, context_length=65)


def test_qwen2_sliding_layers_follow_transformers_rules():
    base = {
        "model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64, "sliding_window": 16,
    }  # fmt: skip
    # use_sliding_window false (Qwen2's default): the window is unused, whatever it says.
    assert config_from_hf({**base, "use_sliding_window": False}).context_length == 64
    # Sliding from layer 2 of 2: no layer slides.
    assert config_from_hf({**base, "use_sliding_window": True, "max_window_layers": 2}).context_length == 64
    for sliding in ({"max_window_layers": 1}, {"layer_types": ["full_attention", "sliding_attention"]}):
        with pytest.raises(ValueError, match="sliding_window=16 is shorter than the context of 64 tokens"):
            config_from_hf({**base, "use_sliding_window": True, **sliding})
        assert config_from_hf({**base, "use_sliding_window": True, **sliding}, context_length=16).context_length == 16
    with pytest.raises(ValueError, match="layer_types must list one of"):
        config_from_hf({**base, "use_sliding_window": True, "layer_types": ["full_attention"]})


def test_qwen2_sliding_window_refusal_matches_what_transformers_computes(tmp_path):
    # The rule above is transformers' own: a Qwen2 whose top layer slides over 16 tokens differs from full
    # attention past 16 tokens, and equals tlm's import at 16.
    hf = qwen2(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path, context_length=16)
    ids = torch.randint(0, VOCAB, (1, 16))
    torch.testing.assert_close(logits(model, ids), logits(hf, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "gemma"}, "model_type must be one of"),
        ({"architectures": ["LlamaForCausalLM"]}, r"architectures must be \['Qwen2ForCausalLM'\]"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, r"unknown keys \['attention_bias'\]"),
        ({"sliding_window": 0, "use_sliding_window": True}, "sliding_window must be"),
    ],
)
def test_qwen2_settings_tlm_cannot_compute_are_refused(change, match):
    config = {
        "model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64, **change,
    }  # fmt: skip
    with pytest.raises((ValueError, TypeError), match=match):
        config_from_hf(config)


def test_a_llama_still_refuses_a_sliding_window():
    config = {
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64, "sliding_window": 16,
    }  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window=16"):
        config_from_hf(config)
