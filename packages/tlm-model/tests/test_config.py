import dataclasses

import pytest

from tlm_model import PRESETS, ModelConfig


def test_course_preset_is_the_course_model():
    assert ModelConfig.from_preset("course-tinystories") == ModelConfig(
        vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344, rope_theta=10_000.0
    )


@pytest.mark.parametrize(
    "name, d_model, num_layers, num_heads, d_ff",
    [
        ("gpt2-small", 768, 12, 12, 3072),
        ("gpt2-medium", 1024, 24, 16, 4096),
        ("gpt2-large", 1280, 36, 20, 5120),
        ("gpt2-xl", 1600, 48, 25, 6400),
    ],
)
def test_gpt2_presets_follow_the_accounting_problem(name, d_model, num_layers, num_heads, d_ff):
    cfg = PRESETS[name]
    assert (cfg.vocab_size, cfg.context_length, cfg.rope_theta) == (50_257, 1_024, 10_000.0)
    assert (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.d_ff) == (d_model, num_layers, num_heads, d_ff)


def test_dict_round_trip_and_immutability():
    cfg = PRESETS["gpt2-small"]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 1  # type: ignore[misc]


def test_an_unknown_preset_is_refused():
    with pytest.raises(ValueError, match=r"unknown preset 'gpt3'; expected one of \['course-tinystories'"):
        ModelConfig.from_preset("gpt3")


BASE = dict(vocab_size=100, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=64)


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(vocab_size=0), ValueError, "vocab_size must be positive, got 0"),
        (dict(d_ff=64.0), TypeError, "d_ff must be an int, got float"),
        (dict(rope_theta=-1.0), ValueError, "rope_theta must be a finite number > 0, got -1.0"),
        (dict(norm_eps="x"), TypeError, "norm_eps must be a number, got str"),
        (
            dict(norm_placement="sandwich"),
            ValueError,
            r"norm_placement must be one of \['none', 'post', 'pre'\], got 's",
        ),
        (dict(positions="alibi"), ValueError, r"ModelConfig.positions must be one of \['none', 'rope'\], got 'alibi'"),
        (dict(ffn="relu"), ValueError, r"ModelConfig.ffn must be one of \['silu', 'swiglu'\], got 'relu'"),
        (
            dict(positions="none", rope_scaling={"rope_type": "linear", "factor": 2.0}),
            ValueError,
            "rope_scaling must be None with positions='none'",
        ),
    ],
)
def test_validation(change, exc, match):
    with pytest.raises(exc, match=match):
        ModelConfig(**{**BASE, **change})


def test_the_ablation_fields_default_to_the_course_model_and_round_trip():
    cfg = ModelConfig(**BASE)
    assert (cfg.norm_placement, cfg.positions, cfg.ffn) == ("pre", "rope", "swiglu")
    ablated = ModelConfig(**BASE, norm_placement="post", positions="none", ffn="silu")
    assert ModelConfig.from_dict(ablated.to_dict()) == ablated
    # RoPE pairs features; without it an odd head width is a valid model.
    assert ModelConfig(**{**BASE, "num_heads": 32}, positions="none").d_head == 1
