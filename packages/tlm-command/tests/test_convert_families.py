"""``tlm convert --from-hf`` of a Qwen2 and a Mistral folder that transformers built from random tiny configs."""

import json

import pytest
import torch

from tlm_command.main import main
from tlm_model import load_model_file

transformers = pytest.importorskip("transformers")


def randomized(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.eval()


SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def test_qwen2_round_trip_through_the_command(tmp_path, capsys):
    hf = randomized(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE)))
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "tlm"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["qkv_bias"] is True
    model = load_model_file(tmp_path / "tlm")
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(model(ids), ref, rtol=1e-5, atol=1e-5)
    assert main(["convert", "--to-hf", str(tmp_path / "tlm"), "--out", str(tmp_path / "back")]) == 0
    assert "-> HF Qwen2 folder" in capsys.readouterr().out
    card = (tmp_path / "back" / "README.md").read_text()
    assert "tags: [tlm, qwen2]" in card and "A Qwen2-architecture language model" in card
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=0, atol=0)


def test_mistral_needs_a_context_within_its_window(tmp_path, capsys):
    config = transformers.MistralConfig(**SHAPE, sliding_window=16)
    hf = randomized(transformers.MistralForCausalLM(config))
    hf.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tlm: error:") and len(err.splitlines()) == 1
    assert "sliding_window=16" in err and "--context-length 16" in err
    assert not (tmp_path / "out").exists()
    argv = ["convert", "--from-hf", str(tmp_path / "hf"), "--context-length", "16", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    model = load_model_file(tmp_path / "out")
    assert model.config.context_length == 16
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_context_length_goes_with_from_hf_only(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--to-hf", str(tmp_path / "run"), "--context-length", "16", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "--context-length goes with --from-hf" in capsys.readouterr().err
