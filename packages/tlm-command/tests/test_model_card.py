"""Every HF export has a README.md model card: its metadata read by huggingface_hub, the facts from the run."""

import json

import pytest

from tlm_command.main import main

huggingface_hub = pytest.importorskip("huggingface_hub")


def test_a_run_export_has_a_card_with_the_runs_facts(run, tmp_path):
    assert main(["convert", "--to-hf", str(run / "checkpoints" / "step_00000012"), "--out", str(tmp_path / "hf")]) == 0
    card = huggingface_hub.ModelCard.load(tmp_path / "hf" / "README.md")
    assert card.data.library_name == "transformers" and card.data.license is None  # the license is the user's
    text = card.text
    info = json.loads((run / "data" / "info.json").read_text())
    val_loss = [r["val_loss"] for r in _records(run) if r.get("step") == 12 and "val_loss" in r]
    assert f"Tokens: {info['train']:,} for training, {info['val']:,} for validation" in text
    assert f"`{info['sources'][0]}`" in text and "- Steps: 12 of 24" in text
    assert f"- Final validation loss: {val_loss[0]:.4f}" in text  # step 12's, not the run's last
    assert "| d_model | 32 |" in text and "special tokens: `<|endoftext|>`" in text and "tlm-model " in text


def test_a_chat_runs_card_gives_its_conversations_and_the_tokens_its_loss_counted(run, tmp_path):
    import shutil

    shutil.copytree(run, tmp_path / "run")
    info = json.loads((run / "data" / "info.json").read_text())
    chat = {"examples": 40, "train_on": "completion", "layout": "packed", "cut_to_context": 0}  # as a chat run's
    (tmp_path / "run" / "data" / "info.json").write_text(json.dumps({**info, "chat": chat}) + "\n")
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    text = (tmp_path / "hf" / "README.md").read_text(encoding="utf-8")
    assert "- Chat fine-tuning: 40 conversations, loss on `completion` tokens" in text


def test_a_model_file_export_says_what_it_does_not_know(small_checkpoint, tmp_path):
    _, folder = small_checkpoint
    assert main(["convert", "--to-hf", str(folder), "--out", str(tmp_path / "hf")]) == 0
    text = (tmp_path / "hf" / "README.md").read_text(encoding="utf-8")
    assert "Not known: this export was not made from a tlm run folder." in text


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
