"""Options that must reach every layer (issue 9, item 6): ``norm_eps`` in every norm, the attention
backend getter and setter, the fused initialisation, and scalar or empty id tensors.

References: the float64 re-derivation of conftest.py, HF transformers' ``LlamaForCausalLM`` in
float64, closed-form truncated-normal statistics, and torch built-ins.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tlm_attention import BACKENDS
from tlm_model import ModelConfig, TransformerBlock, TransformerLM
from tlm_model.interop import hf_llama_config_kwargs, to_hf_llama_state_dict


def block_config(d_model, num_heads, d_ff, max_seq_len=16, theta=10_000.0, **fields):
    # One block's sizes as a ModelConfig; a block uses neither the vocabulary nor the depth.
    return ModelConfig(1, max_seq_len, d_model, 1, num_heads, d_ff, rope_theta=theta, **fields)


SMALL = ModelConfig(vocab_size=53, context_length=24, d_model=32, num_layers=2, num_heads=4, d_ff=48)


def _randomized(model):
    # Non-unit norm gains, so that a norm applied with the wrong weight or eps is visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("norm_eps", [0.3, 2.0])
def test_norm_eps_reaches_every_norm_of_the_lm(norm_eps, fused, lm_reference, record_error):
    # With eps comparable to mean(x²) a norm that ignores eps is off by far more than rounding.
    cfg = ModelConfig(**{**SMALL.to_dict(), "norm_eps": norm_eps})
    model = _randomized(TransformerLM(cfg, fused=fused)).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        got = model(ids)
    expected = lm_reference(model.state_dict(), ids, cfg)
    record_error("LM with large norm_eps vs float64 re-derivation", got, expected)
    # RoPE's tables are float32 even in a float64 model (by design), hence ~1e-8, not 1e-15.
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    default_eps = lm_reference(model.state_dict(), ids, SMALL)
    assert (default_eps - expected).abs().max() > 1e-3  # the eps is observable in the output


def test_norm_eps_reaches_every_norm_of_the_block(block_reference):
    block = _randomized(TransformerBlock(block_config(32, 4, 48, norm_eps=1.5))).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        got = block(x)
    expected = block_reference(block.state_dict(), x, 4, 10_000.0, eps=1.5)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # float32 RoPE tables, as above
    assert (block_reference(block.state_dict(), x, 4, 10_000.0) - got).abs().max() > 1e-3


def test_norm_eps_matches_hf_llama_rms_norm_eps():
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig(**{**SMALL.to_dict(), "norm_eps": 0.7})
    model = _randomized(TransformerLM(cfg)).double().eval()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config_kwargs(cfg))).double().eval()
    hf.load_state_dict(to_hf_llama_state_dict(model.state_dict(), cfg))
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        # Both sides build RoPE angles in float32, in different orders: ~1e-7, far below eps' effect.
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_backend_getter_reports_the_backend_in_use(backend):
    model = TransformerLM(SMALL, attention_backend=backend)
    assert model.attention_backend == backend
    other = next(b for b in BACKENDS if b != backend)
    model.attention_backend = other
    assert model.attention_backend == other


def test_attention_backend_setter_reaches_every_layer():
    model = TransformerLM(SMALL)
    model.attention_backend = "blockwise"
    assert [layer.attn.attention_backend for layer in model.layers] == ["blockwise"] * SMALL.num_layers
    with pytest.raises(ValueError):
        model.attention_backend = "flash"


def _truncated_normal_std(sigma):
    # N(0, σ²) truncated at ±3σ has std σ · sqrt(1 - 6 φ(3) / (Φ(3) - Φ(-3))).
    phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
    return sigma * math.sqrt(1 - 6 * phi3 / math.erf(3 / math.sqrt(2)))


@pytest.mark.parametrize("fused", [False, True])
def test_every_projection_has_the_course_initialisation(fused):
    # Whether or not q/k/v and w1/w3 are fused, each course-layout matrix (d_out, d_in) is drawn from
    # N(0, 2 / (d_in + d_out)) truncated at ±3σ (CS336 §1.4.1).
    d_model, d_ff = 256, 512
    cfg = ModelConfig(vocab_size=64, context_length=8, d_model=d_model, num_layers=1, num_heads=4, d_ff=d_ff)
    sd = TransformerLM(cfg, fused=fused).state_dict()
    for key in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj", "ffn.w1", "ffn.w3", "ffn.w2"):
        w = sd[f"layers.0.{key}.weight"]
        sigma = math.sqrt(2.0 / (w.shape[0] + w.shape[1]))
        assert w.abs().max().item() <= 3 * sigma * (1 + 1e-6), key
        # 65k+ samples: the sample std is within 1% of the population's with overwhelming probability.
        assert w.std().item() == pytest.approx(_truncated_normal_std(sigma), rel=0.02), key
        assert w.mean().item() == pytest.approx(0.0, abs=0.02 * sigma), key
    # q, k and v are drawn independently, not copies of one another.
    q, k = sd["layers.0.attn.q_proj.weight"], sd["layers.0.attn.k_proj.weight"]
    assert torch.corrcoef(torch.stack([q.flatten(), k.flatten()]))[0, 1].abs() < 0.02


def test_reset_parameters_redraws_the_fused_weights_with_the_same_statistics():
    cfg = ModelConfig(vocab_size=64, context_length=8, d_model=256, num_layers=1, num_heads=4, d_ff=512)
    model = TransformerLM(cfg, fused=True)
    before = model.state_dict()["layers.0.attn.q_proj.weight"].clone()
    model.reset_parameters()
    after = model.state_dict()["layers.0.attn.q_proj.weight"]
    assert not torch.equal(before, after)
    assert after.std().item() == pytest.approx(_truncated_normal_std(math.sqrt(1 / 256)), rel=0.02)


def test_scalar_and_empty_id_tensors_are_refused_by_the_lm():
    model = TransformerLM(SMALL)
    with pytest.raises(ValueError, match="in_indices must have shape"):
        model(torch.tensor(3))
    for empty in (torch.zeros(0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match="in_indices must hold at least one token"):
            model(empty)
    with pytest.raises(TypeError, match="in_indices must be a torch.Tensor"):
        model([1, 2, 3])


def test_one_dimensional_ids_give_one_dimensional_logits(lm_reference):
    model = TransformerLM(SMALL).double()
    ids = torch.randint(0, SMALL.vocab_size, (6,))
    with torch.no_grad():
        got = model(ids)
    assert got.shape == (6, SMALL.vocab_size)
    torch.testing.assert_close(got, lm_reference(model.state_dict(), ids, SMALL))


def test_context_length_is_the_limit_with_and_without_a_cache():
    model = TransformerLM(SMALL)
    with torch.no_grad():
        model(torch.zeros(1, SMALL.context_length, dtype=torch.long))  # exactly full: fine
        with pytest.raises(ValueError, match="in_indices has 25 tokens but the model's context_length is 24"):
            model(torch.zeros(1, SMALL.context_length + 1, dtype=torch.long))
        cache = model.new_kv_cache(1)
        model(torch.zeros(1, 20, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="in_indices has 5 tokens after 20 cached but"):
            model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
        model(torch.zeros(1, 4, dtype=torch.long), kv_cache=cache)  # fills the context exactly


def test_kv_cache_list_must_have_one_cache_per_layer():
    model = TransformerLM(SMALL)
    with pytest.raises(ValueError, match=r"kv_cache must hold one KVCache per layer \(2\), got 1"):
        model(torch.zeros(1, 3, dtype=torch.long), kv_cache=model.new_kv_cache(1)[:1])


def test_new_kv_cache_capacity_dtype_and_device():
    model = TransformerLM(SMALL)
    caches = model.new_kv_cache(3)
    assert len(caches) == SMALL.num_layers and len({id(c) for c in caches}) == SMALL.num_layers
    assert all(c.keys.shape == (3, 4, SMALL.context_length, 8) and c.keys.dtype == torch.float32 for c in caches)
    assert model.new_kv_cache(1, capacity=1)[0].capacity == 1
    assert model.new_kv_cache(1, dtype=torch.float64)[0].values.dtype == torch.float64
    with pytest.raises(ValueError, match=r"capacity must be in \[1, context_length=24\], got 0"):
        model.new_kv_cache(1, capacity=0)


def test_loss_equals_cross_entropy_of_the_forward():
    model = TransformerLM(SMALL).double()
    ids = torch.randint(0, SMALL.vocab_size, (2, 10))
    targets = torch.randint(0, SMALL.vocab_size, (2, 10))
    expected = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(model.loss(ids, targets, chunk_size=7), expected)
    with pytest.raises(ValueError, match="targets must be a tensor shaped like in_indices"):
        model.loss(ids, targets[:, :5])


def test_num_parameters_is_the_sum_of_every_parameter():
    cfg = SMALL
    model = TransformerLM(cfg)
    d, f, v, layers = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.num_layers
    assert model.num_parameters() == 2 * v * d + d + layers * (4 * d * d + 3 * d * f + 2 * d)


def test_norm_eps_defaults_to_the_course_value():
    model = TransformerLM(ModelConfig(vocab_size=11, context_length=4, d_model=8, num_layers=2, num_heads=2, d_ff=16))
    assert model.config.norm_eps == 1e-5
    # Rename-proof: read eps from every RMSNorm module, whatever the attribute path.
    norms = [m for m in model.modules() if type(m).__name__ == "RMSNorm"]
    assert len(norms) == 2 * 2 + 1 and all(m.eps == 1e-5 for m in norms)
