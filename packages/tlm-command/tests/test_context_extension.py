"""``tlm train --init-from RUN --context-length N --rope-scaling RULE``: a trained model's context grows (the
context length is no weight shape), and eval, generate and the HF export work at the longer context."""

import json
from pathlib import Path

import pytest
import torch

from tlm_command.main import main

TUNE = ["--steps", "2", "--batch-size", "2", "--eval-batches", "1", "--peak-flops", "1e9", "--sample-tokens", "0",
        "--checkpoint-interval", "2", "--quiet"]  # fmt: skip


@pytest.fixture(scope="module")
def extended(run: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared run (context 32) fine-tuned at context 128 with YaRN (factor 4, from the contexts)."""
    out = tmp_path_factory.mktemp("extended") / "run"
    argv = ["train", "--init-from", str(run), "--data", str(corpus), "--out-dir", str(out),
            "--context-length", "128", "--rope-scaling", "yarn", *TUNE]  # fmt: skip
    assert main(argv) == 0
    return out


def test_the_extended_run_has_the_longer_context_and_the_completed_rule(run, extended):
    import tlm_artifacts

    base = tlm_artifacts.model_config(tlm_artifacts.resolve(str(run)))
    config = tlm_artifacts.model_config(tlm_artifacts.resolve(str(extended)))
    assert base.context_length == 32 and config.context_length == 128
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    # Nothing else of the shape changed: the weights loaded as they were.
    changed = {k for k, v in config.to_dict().items() if v != base.to_dict()[k]}
    assert changed == {"context_length", "rope_scaling"}


def test_eval_and_generate_run_at_the_longer_context(extended, held_out, capsys):
    capsys.readouterr()
    argv = ["eval", "--checkpoint", str(extended), "--data", str(held_out), "--max-tokens", "600", "--json", "--quiet"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["context_length"] == 128
    prompt = "def " * 60  # 60 tokens or more: past the original 32-token context
    argv = ["generate", "--checkpoint", str(extended), "--prompt", prompt, "--max-new-tokens", "20",
            "--temperature", "0", "--quiet"]  # fmt: skip
    assert main(argv) == 0


def test_the_hf_export_carries_the_scaling(extended, tmp_path):
    transformers = pytest.importorskip("transformers")
    import tlm_artifacts

    assert main(["convert", "--to-hf", str(extended), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.rope_parameters["rope_type"] == "yarn" and hf.config.max_position_embeddings == 128
    model, _ = tlm_artifacts.load_model(tlm_artifacts.resolve(str(extended)))
    ids = torch.randint(0, model.config.vocab_size, (1, 128))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-5)


def test_an_extended_run_resumes_with_the_same_flags(run, corpus, tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--init-from", str(run), "--data", str(corpus), "--out-dir", str(out),
            "--context-length", "64", "--rope-scaling", "linear", "--rope-factor", "2.5", *TUNE]  # fmt: skip
    assert main(argv) == 0
    resume = [*argv[:7], "--resume", str(out), *argv[7:]]
    resume[resume.index("--steps") + 1] = "4"
    assert main(resume) == 0
    import tlm_artifacts

    config = tlm_artifacts.model_config(tlm_artifacts.resolve(str(out)))
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.5} and config.context_length == 64


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--rope-scaling", "yarn"], "names a rule, which extends the context of an --init-from model"),
        (["--rope-scaling", "ntk2"], "must be one of linear, dynamic, yarn, llama3, ntk or a JSON object"),
        (["--rope-factor", "2"], "--rope-factor goes with --init-from and a rope_scaling rule"),
    ],
)
def test_extension_flags_are_refused_in_one_line_without_what_they_extend(extra, fragment, corpus, tmp_path, fails):
    fails(["train", "--data", str(corpus), "--out-dir", str(tmp_path / "run"), *extra], fragment)


def test_a_fine_tune_still_keeps_every_other_field_and_a_scaled_rope_is_not_stacked(extended, corpus, tmp_path, fails):
    fails(["train", "--init-from", str(extended), "--data", str(corpus), "--out-dir", str(tmp_path / "a"),
           "--d-model", "64"], "a fine-tune keeps the model's shape")  # fmt: skip
    fails(["train", "--init-from", str(extended), "--data", str(corpus), "--out-dir", str(tmp_path / "b"),
           "--context-length", "256", "--rope-scaling", "linear"], "already scaled")  # fmt: skip


def test_a_lora_run_at_a_longer_context_exports_merged_not_as_a_peft_adapter(run, corpus, tmp_path, fails):
    out = tmp_path / "lora"
    argv = ["train", "--init-from", str(run), "--data", str(corpus), "--out-dir", str(out), "--lora-rank", "2",
            "--context-length", "64", "--rope-scaling", "linear", *TUNE]  # fmt: skip
    assert main(argv) == 0
    # The adapter would be read onto the base's HF export, at the base's context and RoPE: refused.
    fails(["convert", "--to-peft", str(out), "--out", str(tmp_path / "peft")],
          "it extended the base's context (32 tokens", "--to-hf --merge")  # fmt: skip
    assert main(["convert", "--to-hf", str(out), "--merge", "--out", str(tmp_path / "merged")]) == 0
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["max_position_embeddings"] == 64 and config["rope_parameters"]["rope_type"] == "linear"
