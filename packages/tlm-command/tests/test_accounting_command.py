"""`tlm accounting`: the report of tlm_model.accounting as JSON and tables, against closed forms."""

import json

import pytest

from tlm_command.main import main
from tlm_model import PRESETS
from tlm_model.accounting import COMPONENTS


def closed_form_forward_flops(cfg, batch: int, seq: int) -> int:
    """The course's (full QKᵀ) count, written out: per layer 4 d×d projections, QKᵀ and AV over seq², three
    d×d_ff FFN matrices; then the LM head."""
    d, t = cfg.d_model, seq
    per_layer = 4 * 2 * t * d * d + 2 * 2 * t * t * d + 3 * 2 * t * d * cfg.d_ff
    return batch * (cfg.num_layers * per_layer + 2 * t * d * cfg.vocab_size)


def test_cli_json(capsys):
    assert main(["accounting", "--preset", "gpt2-xl", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params_total"] == 2_127_057_600
    assert data["param_bytes_fp32"] == 4 * 2_127_057_600
    assert data["forward_flops_total"] == closed_form_forward_flops(PRESETS["gpt2-xl"], 1, 1024)
    assert data["forward_flops_causal"] < data["forward_flops_total"]
    assert set(data["components"]) == set(COMPONENTS)
    assert sum(c["share"] for c in data["components"].values()) == pytest.approx(1.0)


def test_cli_context_length_and_batch(capsys):
    assert main(["accounting", "--preset", "gpt2-xl", "--context-length", "16384", "--batch-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["seq_len"], data["batch_size"], data["config"]["context_length"]) == (16_384, 2, 16_384)
    assert data["forward_flops_total"] == closed_form_forward_flops(PRESETS["gpt2-xl"], 2, 16_384)


def test_cli_tables(capsys):
    assert main(["accounting", "--preset", "gpt2-small"]) == 0
    table = capsys.readouterr().out
    assert "190,460,160" in table and "feed-forward" in table and "estimate" in table
    assert main(["accounting", "--compare", "gpt2-small", "gpt2-xl"]) == 0
    comparison = capsys.readouterr().out
    assert "gpt2-small" in comparison.splitlines()[0] and "gpt2-xl" in comparison.splitlines()[0]


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs the optional matplotlib (tlm-model[plot])")
    out = tmp_path / "shares.png"
    assert main(["accounting", "--compare", "gpt2-small", "gpt2-medium", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_replaces_a_symlink_never_its_target_and_refuses_a_folder(tmp_path, capsys, fails):
    pytest.importorskip("matplotlib", reason="--plot needs the optional matplotlib (tlm-model[plot])")
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"keep")
    link = tmp_path / "shares"  # a symlink, and no suffix: a PNG at exactly this path, not shares.png beside it
    link.symlink_to(victim)
    assert main(["accounting", "--preset", "tiny", "--plot", str(link)]) == 0
    assert victim.read_bytes() == b"keep" and not link.is_symlink()
    assert link.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "shares.png").exists()
    capsys.readouterr()
    fails(["accounting", "--preset", "tiny", "--plot", str(tmp_path)], f"--plot {tmp_path} is a folder")
    fails(["accounting", "--preset", "tiny", "--plot", ""], "--plot is empty; name the image file to write")


def test_cli_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["accounting", "--preset", "gpt2-xl", "--context-length", "0"])
    assert "must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["accounting"])
    assert "one of the arguments --preset --compare is required" in capsys.readouterr().err
