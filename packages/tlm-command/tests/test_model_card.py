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


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_runs_files_that_are_not_files_leave_the_card_without_their_facts_and_never_block(tmp_path, kind):
    """info.json and metrics.jsonl go through the checked read: a FIFO or folder in their place is a fact not
    known, never a read that waits for a writer (the card is written by every HF export of a run)."""
    import os
    import threading
    from types import SimpleNamespace

    from tlm_artifacts import RunFolder
    from tlm_command.model_card import _training

    run = RunFolder(tmp_path / "run")
    for path in (run.data_dir / "info.json", run.metrics_path):
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path) if kind == "fifo" else path.mkdir()  # no writer: a blocking open would wait for ever
    lines = []
    thread = threading.Thread(target=lambda: lines.extend(_training(SimpleNamespace(run=run), 3)), daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the card's reads blocked"
    assert lines == ["- Training data: tlm’s built-in corpus", "- Steps: 3", "- Final validation loss: not recorded"]
