"""``tlm convert --from-hf`` / ``--to-hf`` against HF transformers' LlamaForCausalLM."""

import json

import pytest
import torch

from tlm_model import load_checkpoint
from tlm_model.cli import main

transformers = pytest.importorskip("transformers")


def random_hf(tie):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_through_the_command_keeps_hf_logits(tie, tmp_path, capsys):
    hf = random_hf(tie)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "tlm"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["num_kv_heads"] == 2 and report["config"]["tie_word_embeddings"] is tie
    model = load_checkpoint(tmp_path / "tlm")
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(model(ids), ref, rtol=1e-5, atol=1e-5)
    assert main(["convert", "--to-hf", str(tmp_path / "tlm"), "--out", str(tmp_path / "back")]) == 0
    assert "-> HF Llama folder" in capsys.readouterr().out
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=0, atol=0)


def test_unsupported_config_is_one_line_naming_the_key(tmp_path, capsys):
    random_hf(False).save_pretrained(tmp_path)
    capsys.readouterr()  # transformers' own progress bars
    config = json.loads((tmp_path / "config.json").read_text())
    config["sliding_window"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--from-hf", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tlm: error:") and "sliding_window=32" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "--from-hf", "NOPE", "--out", "x"],
        ["convert", "--to-hf", "NOPE", "--out", "x"],
        ["convert", "--out", "x"],
        ["convert", "--from-hf", "a", "--to-hf", "b", "--out", "x"],
    ],
)
def test_user_errors_exit_2_without_traceback(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("tlm: error:")
