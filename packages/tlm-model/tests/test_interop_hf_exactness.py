"""from_hf / save_hf against HF transformers' LlamaForCausalLM, with random weights.

The configurations are the published ones of SmolLM2-135M, TinyLlama-1.1B and Llama-3.2-1B, shrunk
in layers, width and vocabulary for a 2-core CPU while keeping each model's GQA ratio, head_dim,
RoPE θ, tie flag and RoPE scaling (Llama-3.2's llama3 rule).
"""

import dataclasses
import json

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM, from_hf, generate, save_hf
from tlm_model.interop import config_from_hf, hf_llama_config_kwargs, to_hf_llama_state_dict

transformers = pytest.importorskip("transformers")

PUBLISHED = {
    # name: (heads, kv_heads, head_dim, rope_theta, tie, rms_norm_eps) from each model's config.json
    "SmolLM2-135M": (9, 3, 64, 100_000.0, True, 1e-5),
    "TinyLlama-1.1B": (32, 4, 64, 10_000.0, False, 1e-5),
    "Llama-3.2-1B": (32, 8, 64, 500_000.0, True, 1e-5),
}
LLAMA3 = {
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # fmt: skip
SCALING = {"Llama-3.2-1B": LLAMA3}
SHRUNK_HEADS = {"SmolLM2-135M": (9, 3), "TinyLlama-1.1B": (8, 1), "Llama-3.2-1B": (8, 2)}  # same ratio


def hf_config(name, scaling=None):
    heads, kv, head_dim, theta, tie, eps = PUBLISHED[name]
    heads, kv = SHRUNK_HEADS[name]
    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=heads * head_dim,
        intermediate_size=3 * heads * head_dim,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=256,
        rms_norm_eps=eps,
        rope_parameters={"rope_type": "default", **(scaling or SCALING.get(name, {})), "rope_theta": theta},
        tie_word_embeddings=tie,
        hidden_act="silu",
    )


def random_hf_model(name, scaling=None):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config(name, scaling)).eval()
    with torch.no_grad():  # HF initialises RMSNorm weights to 1; random ones test the mapping too
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


def rel_err(got, ref):
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("name", list(PUBLISHED))
@pytest.mark.parametrize("shard", [False, True])
def test_from_hf_matches_llama_logits_and_greedy_tokens(name, shard, tmp_path, record_error):
    hf = random_hf_model(name)
    hf.save_pretrained(tmp_path, max_shard_size="1MB" if shard else "50GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    model = from_hf(tmp_path)
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert model.config.kv_heads == hf.config.num_key_value_heads
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids)
    err = rel_err(got, ref)
    record_error(f"from_hf logits vs HF, {name} shape{' (sharded)' if shard else ''}", got, ref)
    assert err < 1e-5
    prompt = ids[:1, :6]
    with torch.no_grad():
        hf_tokens = hf.generate(prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(generate(model, prompt, 12, temperature=0), hf_tokens)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_save_hf_loads_in_transformers_with_equal_logits(name, tmp_path, record_error):
    hf = random_hf_model(name)
    hf.save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    save_hf(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.tie_word_embeddings == model.config.tie_word_embeddings
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        ref, got = back(ids).logits, model(ids)
        original = hf(ids).logits
    err = rel_err(ref, got)
    record_error(f"save_hf -> from_pretrained logits vs tlm, {name} shape", ref, got)
    assert err < 1e-5
    torch.testing.assert_close(ref, original, rtol=0, atol=0)  # the exported weights are HF's exactly
    # And back again: the exported folder imports to the same model.
    again = from_hf(tmp_path / "out")
    assert again.config == model.config
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_tied_import_is_one_parameter(tmp_path):
    random_hf_model("SmolLM2-135M").save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert model.lm_head.weight is model.token_embeddings.weight


def test_a_config_without_tie_word_embeddings_is_untied_as_in_transformers(tmp_path):
    # transformers' LlamaConfig decides the default: an untied head, read from the folder's lm_head.weight.
    model = random_hf_model("TinyLlama-1.1B")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert transformers.AutoConfig.from_pretrained(tmp_path).tie_word_embeddings is False
    assert config_from_hf(config).tie_word_embeddings is False
    ids = torch.randint(0, 512, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(from_hf(tmp_path)(ids), model(ids).logits, rtol=1e-5, atol=1e-5)


def test_llama3_scaling_is_applied_over_a_full_context(tmp_path, record_error):
    # Over the whole 256-token context the llama3 rule matters: dropping it (what tlm did before,
    # silently) is ~6e-3 off, far outside the 1e-5 the import keeps.
    hf = random_hf_model("Llama-3.2-1B")
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert model.config.rope_scaling == LLAMA3
    unscaled = TransformerLM(dataclasses.replace(model.config, rope_scaling=None))
    unscaled.load_state_dict(model.state_dict())
    ids = torch.randint(0, 512, (1, 256))
    with torch.no_grad():
        ref, got = hf(ids).logits, model(ids)
        record_error("from_hf logits vs HF, Llama-3.2-1B shape + llama3, 256 tokens", got, ref)
        assert rel_err(got, ref) < 1e-5
        assert rel_err(unscaled(ids), ref) > 1e-3


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda s: s["rope_type"],
)
def test_other_scalings_import_with_hf_logits(scaling, tmp_path, record_error):
    hf = random_hf_model("TinyLlama-1.1B", scaling)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        ref, got = hf(ids).logits, model(ids)
    record_error(f"from_hf logits vs HF, TinyLlama shape + {scaling['rope_type']} scaling", got, ref)
    assert rel_err(got, ref) < 1e-5
    save_hf(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"sliding_window": 4096}, "sliding_window=4096"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type='longrope'"),
        (
            {
                "rope_parameters": {
                    "rope_type": "linear",
                    "rope_theta": 1e4,
                    "factor": 2.0,
                    "partial_rotary_factor": 0.5,
                }
            },
            r"does not take keys \['partial_rotary_factor'\]",
        ),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'default'"),
        ({"some_new_switch": 1}, "unknown keys \\['some_new_switch'\\]"),
        ({"model_type": "gemma"}, r"model_type must be one of \['llama', 'mistral', 'qwen2'\]"),
        ({"model_type": "mistral", "architectures": ["LlamaForCausalLM"]}, r"must be \['MistralForCausalLM'\]"),
    ],
)
def test_unsupported_settings_are_refused_by_name(changes, match):
    cfg = {**json.loads(hf_config("TinyLlama-1.1B").to_json_string()), **changes}
    with pytest.raises(ValueError, match=match):
        config_from_hf(cfg)


def test_attention_bias_tensors_are_refused_by_name(tmp_path):
    cfg = hf_config("TinyLlama-1.1B")
    cfg.attention_bias = True
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["attention_bias"] = False  # a config that lies: the bias tensors must still be refused
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"no place for tensors \['model.layers.0.self_attn.k_proj.bias'"):
        from_hf(tmp_path)


def test_missing_folder_is_an_oserror(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_hf(tmp_path)


def test_half_layout_import_keeps_hf_rows_and_logits(tmp_path, record_error):
    hf = random_hf_model("Llama-3.2-1B")
    hf.save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf", rope_layout="half")
    assert model.config.rope_layout == "half" and model.rope.layout == "half"
    # No reordering: tlm's q rows are HF's rows as they are.
    torch.testing.assert_close(
        model.state_dict()["layers.0.attn.q_proj.weight"], hf.model.layers[0].self_attn.q_proj.weight, rtol=0, atol=0
    )
    ids = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        ref, got = hf(ids).logits, model(ids)
    record_error("from_hf(rope_layout='half') logits vs HF, Llama-3.2-1B shape", got, ref)
    assert rel_err(got, ref) < 1e-5
    save_hf(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=0, atol=0)


def test_norm_eps_matches_hf_llama_rms_norm_eps():
    cfg = ModelConfig(vocab_size=53, context_length=24, d_model=32, num_layers=2, num_heads=4, d_ff=48, norm_eps=0.7)
    model = TransformerLM(cfg).double().eval()
    with torch.no_grad():  # gains away from 1, so that eps is not hidden behind a unit weight
        for name, p in model.named_parameters():
            if "ln" in name:
                p.uniform_(0.5, 1.5)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config_kwargs(cfg))).double().eval()
    hf.load_state_dict(to_hf_llama_state_dict(model.state_dict(), cfg))
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        # Both sides build RoPE angles in float32, in different orders: ~1e-7, far below eps' effect.
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-6)
