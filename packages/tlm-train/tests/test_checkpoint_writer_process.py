"""DCP's writer process and stager as BackgroundSaver uses them. Ending the writer process: torch keeps it in a
module global for the interpreter's life; ending it sends it its own shutdown (``__del__``) once and forgets it, so
the next run starts its own. Stand-ins take the process's and the stager's places: nothing is spawned here."""

import pytest

from tlm_train.checkpoint import _stop_writer_process


class _Process:
    def __init__(self) -> None:
        self.ended = 0

    def __del__(self) -> None:
        self.ended += 1


def test_the_writer_process_is_ended_once_and_forgotten(monkeypatch):
    executor = pytest.importorskip("torch.distributed.checkpoint._async_process_executor")
    process = _Process()
    monkeypatch.setattr(executor, "_CHECKPOINT_PROCESS", process, raising=False)
    _stop_writer_process()
    assert executor._CHECKPOINT_PROCESS is None and process.ended == 1
    _stop_writer_process()  # none left: nothing to end
    assert executor._CHECKPOINT_PROCESS is None and process.ended == 1


@pytest.mark.parametrize("shared", [False, True])
def test_a_cpu_states_sharded_save_stages_a_fresh_copy_in_pageable_memory(monkeypatch, shared):
    """Pinned (page-locked) host buffers serve copies from an accelerator; a CPU state's stager asks for none, each
    save having its own stager. torch's StagingOptions defaults to pinned memory, so the option must be said."""
    staging = pytest.importorskip("torch.distributed.checkpoint.staging")
    from tlm_train.checkpoint import BackgroundSaver

    made = []
    monkeypatch.setattr(staging, "DefaultStager", lambda options: made.append(options) or object())
    assert staging.StagingOptions().use_pinned_memory  # the default the call must override
    stager, own = BackgroundSaver()._shard_stager(False, shared=shared)  # submit's decision for a CPU state
    (options,) = made
    assert own is True and stager is not None
    assert options.use_pinned_memory is False and options.use_non_blocking_copy is False
    assert options.use_shared_memory is shared and options.use_async_staging is True
