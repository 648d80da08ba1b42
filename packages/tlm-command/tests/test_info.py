"""`tlm info`: presets and their parameter counts, against the closed form."""

import json

import pytest

from tlm_command.main import main
from tlm_model import ModelConfig


def closed_form_parameters(cfg: ModelConfig) -> int:
    per_layer = 4 * cfg.d_model**2 + 3 * cfg.d_model * cfg.d_ff + 2 * cfg.d_model
    return 2 * cfg.vocab_size * cfg.d_model + cfg.num_layers * per_layer + cfg.d_model


def test_cli_info_json(capsys):
    assert main(["info", "--preset", "gpt2-xl", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"] == closed_form_parameters(ModelConfig.from_preset("gpt2-xl"))
    assert (report["d_model"], report["num_layers"], report["d_head"]) == (1600, 48, 64)


def test_cli_info_table_and_listing(capsys):
    assert main(["info", "--preset", "course-tinystories"]) == 0
    table = capsys.readouterr().out
    assert f"{closed_form_parameters(ModelConfig.from_preset('course-tinystories')):,}" in table
    assert main(["info"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in ("course-tinystories", "gpt2-small", "gpt2-xl"))


def test_cli_rejects_unknown_preset(capsys):
    with pytest.raises(SystemExit):
        main(["info", "--preset", "gpt3"])
    assert "invalid choice: 'gpt3'" in capsys.readouterr().err


def test_info_describes_a_run_and_a_step(run, capsys):
    assert main(["info", "--checkpoint", str(run), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["kind"] == "run folder" and described["steps"] == [12, 24] and described["step"] == 24
    assert described["d_model"] == 32 and described["tokenizer"].endswith("tokenizer")
    assert main(["info", "--checkpoint", str(run / "checkpoints" / "step_00000012")]) == 0
    table = capsys.readouterr().out
    assert "step folder" in table and "12" in table
