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
