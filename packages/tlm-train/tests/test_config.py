"""TrainConfig: TOML written by a library and read back equal (any string, the [model] table), every range
checked up front, the model resolved from a preset and [model] fields."""

import pytest

from tlm_model import PRESETS, ModelConfig
from tlm_train import TrainConfig


def test_toml_round_trips_any_string_and_the_model_table(tmp_path) -> None:
    config = TrainConfig(
        data=["a b.txt", 'q"uote.txt', "back\\slash.txt"],
        sample_prompt="ACT I.\r\n\t\x01 ünïcödé \u2028 '''\"\"\"",  # control characters and TOML's own quotes
        lr=1e-4, max_tokens=1000, compile=True, preset="course-tinystories",
        model={"num_kv_heads": 4, "tie_word_embeddings": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    )  # fmt: skip
    path = tmp_path / "c.toml"
    path.write_text(config.to_toml(), encoding="utf-8")
    assert TrainConfig.from_toml(path) == config
    assert "[model]" in path.read_text() and "[model.rope_scaling]" in path.read_text()
    assert TrainConfig.from_toml(path, steps=7).steps == 7
    # Flags override the file's [model] table field by field.
    assert TrainConfig.from_toml(path, model={"d_ff": 999}).model == {**config.model, "d_ff": 999}


def test_none_fields_are_left_out_and_read_back_as_none(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(TrainConfig().to_toml())
    assert "min_lr" not in path.read_text() and TrainConfig.from_toml(path).min_lr is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stepz = 3\n", r"unknown training settings \['stepz'\]"),
        ("steps = [\n", "is not valid TOML"),
        ("[model]\ndropout = 0.1\n", r"TrainConfig.model has unknown fields \['dropout'\]"),
        ("[model]\nd_model = 30\nnum_heads = 4\n", "d_model must be divisible by num_heads"),
        ('steps = "3"\n', r"TrainConfig.steps must be an int, got str \('3'\)"),
    ],
)
def test_bad_files_name_the_file_and_the_setting(tmp_path, text, message) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises((TypeError, ValueError), match=message) as info:
        TrainConfig.from_toml(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"steps": 0}, ValueError, "TrainConfig.steps must be positive, got 0"),
        ({"steps": True}, TypeError, "TrainConfig.steps must be an int, got bool"),
        ({"warmup_steps": -1}, ValueError, "TrainConfig.warmup_steps must be >= 0"),
        ({"sample_prompt": "a\udcffb"}, ValueError, r"TrainConfig.sample_prompt must be UTF-8 text, got 'a\\udcffb'"),
        ({"special_tokens": ["<|x\udcff|>"]}, ValueError, "TrainConfig.special_tokens must be UTF-8 text"),
        ({"seed": 2**32}, ValueError, "TrainConfig.seed must be <= 4294967295, got 4294967296"),
        ({"batch_size": 10**21}, ValueError, "TrainConfig.batch_size must be <= 9223372036854775807, got 10+$"),
        ({"lr": 0.0}, ValueError, "TrainConfig.lr must be a finite number > 0"),
        ({"lr": float("nan")}, ValueError, "TrainConfig.lr must be a finite number > 0, got nan"),
        ({"lr": 1e30}, ValueError, "lr × weight_decay must be < 1"),
        ({"lr": 0.01, "min_lr": 0.1}, ValueError, r"TrainConfig.min_lr must be a finite number in \[0, 0.01\]"),
        ({"beta2": 1.0}, ValueError, r"TrainConfig.beta2 must be a finite number in \[0, 1\)"),
        ({"eps": 0}, ValueError, "TrainConfig.eps must be a finite number > 0"),
        ({"weight_decay": -0.1}, ValueError, "TrainConfig.weight_decay must be a finite number >= 0"),
        ({"grad_clip": float("inf")}, ValueError, "TrainConfig.grad_clip must be a finite number"),
        ({"val_fraction": 1.0}, ValueError, r"TrainConfig.val_fraction must be a finite number in \(0, 1\)"),
        ({"sample_temperature": -1}, ValueError, "TrainConfig.sample_temperature must be a finite number >= 0"),
        ({"peak_flops": 0}, ValueError, "TrainConfig.peak_flops must be a finite number > 0"),
        ({"max_tokens": 0}, ValueError, "TrainConfig.max_tokens must be positive"),
        ({"distributed": "zero3"}, ValueError, "TrainConfig.distributed must be one of"),
        ({"dtype": "float8"}, ValueError, "TrainConfig.dtype must be one of"),
        ({"preset": "gpt5"}, ValueError, "TrainConfig.preset must be one of"),
        ({"token_dtype": "int8"}, ValueError, "TrainConfig.token_dtype must be one of"),
        ({"device": "quantum"}, ValueError, "TrainConfig.device must be a torch device"),
        ({"compile": 1}, TypeError, "TrainConfig.compile must be a bool"),
        ({"data": [3]}, TypeError, "TrainConfig.data must be a list of non-empty strings"),
        ({"special_tokens": "<|endoftext|>"}, TypeError, "TrainConfig.special_tokens must be a list"),
        ({"model": []}, TypeError, "TrainConfig.model must be a table"),
        ({"model": {"num_layers": 0}}, ValueError, "TrainConfig.model: ModelConfig.num_layers must be positive"),
        ({"batch_size": 6, "grad_accum": 4}, ValueError, "must split evenly into grad_accum"),
    ],
)
def test_every_range_is_checked_up_front(settings, error, message) -> None:
    with pytest.raises(error, match=message):
        TrainConfig(**settings)


def test_the_model_is_the_preset_with_model_fields_over_it_and_the_tokenizers_vocabulary() -> None:
    config = TrainConfig(preset="course-tinystories", model={"num_layers": 2, "num_kv_heads": 8})
    model = config.model_config(vocab_size=777)
    assert model == ModelConfig.from_dict({**PRESETS["course-tinystories"].to_dict(), "num_layers": 2,
                                           "num_kv_heads": 8, "vocab_size": 777})  # fmt: skip
    assert TrainConfig().model_config() == PRESETS["tiny"]
    with pytest.raises(ValueError, match="model.vocab_size is 500 but the tokenizer/data has 777 ids"):
        TrainConfig(model={"vocab_size": 500}).model_config(vocab_size=777)


@pytest.mark.parametrize(
    ("model", "d_ff"),
    [
        ({"ffn": "silu"}, 4 * 512),  # the course's SiLU width, not the preset's SwiGLU 1344
        ({"ffn": "silu", "d_model": 256}, 4 * 256),  # at the model's own d_model
        ({"ffn": "silu", "d_ff": 1000}, 1000),  # a given d_ff wins
        ({"ffn": "swiglu"}, 1344),  # the preset's own kind keeps the preset's width
        ({"d_model": 256}, 1344),  # d_model alone re-derives nothing (as before)
    ],
)
def test_changing_the_ffn_kind_takes_the_courses_width_for_it(model, d_ff) -> None:
    assert TrainConfig(preset="course-tinystories", model=model).model_config().d_ff == d_ff


def test_the_ffn_width_holds_over_toml_and_matches_the_parameter_counts(tmp_path) -> None:
    from tlm_model.accounting import count_parameters

    path = tmp_path / "c.toml"
    path.write_text('preset = "course-tinystories"\n[model]\nffn = "silu"\n', encoding="utf-8")
    silu = TrainConfig.from_toml(path).model_config()
    swiglu = PRESETS["course-tinystories"]
    d, layers = 512, 4
    assert (silu.d_model, silu.num_layers, silu.d_ff) == (d, layers, 4 * d)
    # Closed forms (CS336 §7): SiLU 2·d·4d per layer, SwiGLU 3·d·d_ff; both about 8·d² (within 2% here).
    ffn = {name: {k: v for k, v in count_parameters(c).items() if k.startswith("ffn_")} for name, c in
           (("silu", silu), ("swiglu", swiglu))}  # fmt: skip
    assert ffn["silu"] == {"ffn_w1": layers * d * 4 * d, "ffn_w2": layers * 4 * d * d, "ffn_w3": 0}
    assert sum(ffn["swiglu"].values()) == layers * 3 * d * 1344
    assert sum(ffn["silu"].values()) == layers * 8 * d * d == pytest.approx(sum(ffn["swiglu"].values()), rel=0.02)


def test_the_default_tokenizer_vocabulary_is_the_default_presets() -> None:
    # With every default, the tokenizer a run trains fits the preset's model exactly: the model built
    # from it is the preset itself, not one with a different embedding size.
    config = TrainConfig()
    preset = PRESETS[config.preset]
    assert config.vocab_size == preset.vocab_size
    assert config.model_config(vocab_size=config.vocab_size) == preset


def test_total_steps_from_a_token_budget() -> None:
    assert TrainConfig(steps=5).total_steps() == 5
    assert TrainConfig(max_tokens=10_000, batch_size=8).total_steps() == 10  # 8 × 128 tokens a step


def test_the_settings_import_without_torch_and_a_bad_one_is_refused_before_torch_loads() -> None:
    # A fresh interpreter (this one has torch): TrainConfig, ModelConfig and RoPE's names load, and every
    # check but the device's runs, with no torch, which lets `tlm train` refuse a wrong flag at once.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from tlm_train.config import TrainConfig\n"
        "try:\n"
        "    TrainConfig(lr=-1.0)\n"
        "except ValueError as err:\n"
        "    print(err)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["TrainConfig.lr must be a finite number > 0, got -1.0", "False"]


@pytest.mark.parametrize(
    "settings",
    [
        {"lr": 2.0, "weight_decay": 0.499},  # lr × weight_decay just below 1: each step keeps 0.2% of a weight
        {"lr": 0.5, "weight_decay": 0.0},
        {"lr": 0.01, "min_lr": 0.01},  # min_lr may equal lr: [0, lr] is closed
        {"lr": 0.01, "min_lr": 0.0},
        {"beta1": 0.0, "beta2": 0.999999},  # [0, 1)
        {"grad_clip": 0.0, "sample_temperature": 0.0, "warmup_steps": 0, "seed": 0},
        {"val_fraction": 1e-9},
        {"val_fraction": 1 - 1e-9},
        {"steps": 1, "max_tokens": 1},
    ],
)
def test_each_range_admits_its_closed_bounds_and_just_inside_its_open_ones(settings) -> None:
    config = TrainConfig(**settings)
    assert all(getattr(config, name) == value for name, value in settings.items())


@pytest.mark.parametrize(
    ("lr", "weight_decay"),
    [(2.0, 0.5), (1.0, 1.0), (0.25, 4.0)],  # exactly 1: every weight is multiplied by 1 - 1 = 0
)
def test_a_decay_that_zeroes_the_weights_in_one_step_is_refused(lr, weight_decay) -> None:
    assert lr * weight_decay == 1.0
    with pytest.raises(ValueError, match="lr × weight_decay must be < 1"):
        TrainConfig(lr=lr, weight_decay=weight_decay)


def test_on_python_3_10_the_settings_read_toml_with_tomli(tmp_path) -> None:
    # Python 3.10 has no tomllib; the package then depends on tomli (its pyproject), the same parser under its
    # first name. A 3.10 interpreter is stood in for: version_info says 3.10, tomllib cannot be imported, and
    # "tomli" is the standard library's tomllib.
    import subprocess
    import sys

    path = tmp_path / "train.toml"
    path.write_text(TrainConfig(steps=7).to_toml())
    code = (
        "import sys, tomllib\n"
        "sys.version_info = (3, 10, 14, 'final', 0)\n"
        "sys.modules['tomli'], sys.modules['tomllib'] = tomllib, None\n"
        "from tlm_train.config import TrainConfig\n"
        "print(TrainConfig.from_toml(sys.argv[1]).steps)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "7"


def test_every_setting_says_what_it_is():
    # The command line's --help, the docs and the sweep's errors read each field's help from its metadata.
    import dataclasses

    from tlm_train import TrainConfig

    missing = [f.name for f in dataclasses.fields(TrainConfig) if not f.metadata.get("help", "").strip()]
    assert missing == []
