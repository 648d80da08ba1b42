"""RoPE scaling (linear, dynamic NTK, YaRN, Llama 3) against published formulas and HF's
``modeling_rope_utils``."""

import math

import pytest
import torch

from tlm_rope import RotaryPositionalEmbedding, inv_freq_and_factor

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
        "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2,
    },
    # Unequal mscales (DeepSeek-V2's style): the attention factor is their ratio, not 1.
    "yarn-mscale-unequal": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "llama3": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}  # fmt: skip


def test_linear_is_position_interpolation(rope_reference, record_error):
    # Chen et al. 2023: position i is rotated as position i / factor.
    rope = RotaryPositionalEmbedding(10_000.0, 16, 64, scaling=SCALINGS["linear"])
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    expected = rope_reference(x, torch.arange(40, dtype=torch.float64) / 4.0, 10_000.0)
    record_error("rope linear scaling vs interpolated positions", rope(x), expected)
    torch.testing.assert_close(rope(x), expected, rtol=1e-6, atol=1e-6)


def test_llama3_matches_metas_published_apply_scaling():
    # The loop of meta-llama/llama-models `apply_scaling` (Llama 3.1), transcribed in float64.
    theta, dim = 500_000.0, 64
    scaling = SCALINGS["llama3"]
    freqs = [1.0 / theta ** (i / dim) for i in range(0, dim, 2)]
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    expected = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            expected.append(freq)
        elif wavelen > low_wavelen:
            expected.append(freq / 32.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * freq / 32.0 + smooth * freq)
    got, factor = inv_freq_and_factor(theta, dim, scaling)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert factor == 1.0


def _hf_config(scaling, max_positions, rotary_dim=32):
    transformers = pytest.importorskip("transformers")
    params = {"rope_theta": 10_000.0, **scaling}
    if params["rope_type"] == "llama3":
        params["rope_theta"] = 500_000.0
    return transformers.LlamaConfig(
        hidden_size=4 * rotary_dim, num_attention_heads=4, max_position_embeddings=max_positions,
        rope_parameters=params,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(SCALINGS))
def test_inv_freq_and_factor_match_hf_modeling_rope_utils(name, record_error):
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS[name]
    # yarn's attention factor uses factor as given only when max_position_embeddings is consistent.
    config = _hf_config(scaling, max_positions=int(scaling.get("original_max_position_embeddings", 64)))
    theta = config.rope_parameters["rope_theta"]
    ours, factor = inv_freq_and_factor(theta, 32, scaling)
    hf, hf_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, None)
    record_error(f"rope {name} inv_freq vs HF (HF float32)", ours, hf)
    torch.testing.assert_close(ours, hf.double(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(hf_factor, rel=1e-12)


def test_dynamic_ntk_frequencies_grow_with_length_like_hf():
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS["dynamic"]
    config = _hf_config(scaling, max_positions=64)
    for length in (64, 100, 300):
        ours, _ = inv_freq_and_factor(10_000.0, 32, scaling, seq_len=length)
        hf, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=length)
        torch.testing.assert_close(ours, hf.double(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rotation_matches_hf_llama_rotary_embedding(name, record_error):
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    scaling = SCALINGS[name]
    original = scaling.get("original_max_position_embeddings", 64)
    config = _hf_config(scaling, max_positions=original)
    seq = 200 if name != "llama3" else 64  # past the original context, where scaling matters
    q = torch.randn(1, 4, seq, 32)
    positions = torch.arange(seq).unsqueeze(0) + (9000 if name == "llama3" else 0)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    expected, _ = apply_rotary_pos_emb(q, q, cos, sin)
    rope = RotaryPositionalEmbedding(config.rope_parameters["rope_theta"], 32, 16_384, layout="half", scaling=scaling)
    got = rope(q, positions.unsqueeze(1))
    record_error(f"rope {name} rotation vs HF LlamaRotaryEmbedding", got, expected)
    # HF's float32 angles at positions up to 9200 carry ~1e-3 rad errors; ours are float64-derived.
    tol = 5e-3 if name == "llama3" else 1e-4
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        ({"rope_type": "ntk"}, "rope_type"),
        ({"rope_type": "linear"}, r"needs keys \['factor'\]"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, r"does not take keys \['beta_fast'\]"),
        ({"rope_type": "linear", "factor": 0.5}, r"scaling\['factor'\] must be a finite number >= 1, got 0.5"),
        ({"rope_type": "linear", "factor": float("inf")}, r"scaling\['factor'\] must be a finite number >= 1, got inf"),
    ],
)
def test_bad_scaling(scaling, match):
    with pytest.raises(ValueError, match=match):
        RotaryPositionalEmbedding(10_000.0, 16, 32, scaling=scaling)


@pytest.mark.parametrize("factor", ["2", True, None])
def test_a_scaling_factor_that_is_not_a_number_is_a_type_error(factor):
    with pytest.raises(TypeError, match=r"scaling\['factor'\] must be a number, got"):
        RotaryPositionalEmbedding(10_000.0, 16, 32, scaling={"rope_type": "linear", "factor": factor})


def test_extension_scaling_completes_a_rule_against_the_contexts():
    from tlm_rope import extension_scaling

    assert extension_scaling("linear", 128, 512) == {"rope_type": "linear", "factor": 4.0}
    assert extension_scaling("ntk", 128, 256) == {
        "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 128,
    }  # fmt: skip
    assert extension_scaling("llama3", 128, 256, factor=8.0) == {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 128, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }  # fmt: skip
    # Keys the caller gives are kept.
    assert extension_scaling({"rope_type": "yarn", "beta_fast": 16}, 128, 512) == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16,
    }  # fmt: skip
    with pytest.raises(ValueError, match="rope_type must be one of"):
        extension_scaling("longrope", 128, 512)
    with pytest.raises(ValueError, match="needs target > original"):
        extension_scaling("yarn", 128, 128)
    # A rule's own factor stands when no factor is given, and an equal one agrees with it.
    assert extension_scaling({"rope_type": "linear", "factor": 4}, 128, 128) == {"rope_type": "linear", "factor": 4}
    assert extension_scaling({"rope_type": "linear", "factor": 4}, 128, 512, factor=4.0)["factor"] == 4
    with pytest.raises(ValueError, match="original"):  # checked before it divides anything
        extension_scaling("linear", 0, 512)
    with pytest.raises(ValueError, match="factor=2.0 disagrees with the scaling's own factor 4"):
        extension_scaling({"rope_type": "linear", "factor": 4}, 128, 512, factor=2.0)
    with pytest.raises(ValueError, match=r"scaling\['factor'\] must be"):
        extension_scaling("linear", 128, 512, factor=0.5)
    # A factor given is the factor, whatever the contexts (the "target > original" rule is for the default only):
    # a run fine-tuned at its own context with a stretched RoPE, as HF's linear scaling allows.
    assert extension_scaling("linear", 128, 128, factor=2.0) == {"rope_type": "linear", "factor": 2.0}
