"""The model card's reads of a run folder (the card itself is pinned through `tlm convert` in tlm-command)."""

import pytest


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_runs_files_that_are_not_files_leave_the_card_without_their_facts_and_never_block(tmp_path, kind):
    """info.json and metrics.jsonl go through the checked read: a FIFO or folder in their place is a fact not
    known, never a read that waits for a writer (the card is written by every HF export of a run)."""
    import os
    import threading
    from types import SimpleNamespace

    from tlm_artifacts import RunFolder
    from tlm_train.model_card import _training

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


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_the_card_names_the_architecture_the_hf_export_is_written_as(tmp_path, qkv_bias):
    # The Hub reads the card's tags, and the export's config.json says which transformers class loads it: a model
    # with q/k/v biases is written as Qwen2, one without as Llama (tlm_model.hf_config). An export from a model file
    # knows nothing of its training, and says so.
    from types import SimpleNamespace

    from tlm_model import ModelConfig, TransformerLM
    from tlm_model.interop import hf_config
    from tlm_train.model_card import model_card

    config = ModelConfig(vocab_size=32, context_length=16, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                         qkv_bias=qkv_bias)  # fmt: skip
    model = TransformerLM(config)
    hf = hf_config(config)
    artifact = SimpleNamespace(run=None, path=tmp_path / "model", describe=lambda: "model file")
    card = model_card(model, None, artifact, None).decode("utf-8")
    lines = card.splitlines()
    assert lines[0] == "---" and f"tags: [tlm, {hf['model_type']}]" in lines[: lines.index("---", 1)]
    architecture = hf["architectures"][0].removesuffix("ForCausalLM")
    assert f"A {architecture}-architecture language model trained with tlm" in card
    assert "Not known: this export was not made from a tlm run folder." in card
