"""What a run checks of the machine before it writes anything (each micro-batch splits evenly among the ranks),
and what ``train`` hands to the run."""

import pytest
import torch
import torch.distributed as dist

from tlm_train import TrainConfig
from tlm_train.distributed import DistInfo
from tlm_train.recipe import _check_runtime


def _check(tmp_path, monkeypatch, batch_size, grad_accum, world_size):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # as under torchrun, which these ranks stand for
    config = TrainConfig(out_dir=str(tmp_path / "run"), batch_size=batch_size, grad_accum=grad_accum, distributed="ddp")
    _check_runtime(config, DistInfo(0, world_size, 0, torch.device("cpu")), resume=False)


# micro-batches of 4 over 2 ranks (2 windows each) and over 4 (1 each); of 8 over 8.
@pytest.mark.parametrize(("batch_size", "grad_accum", "world_size"), [(8, 2, 2), (8, 2, 4), (8, 1, 8)])
def test_a_micro_batch_that_divides_among_the_ranks_is_admitted(
    tmp_path, monkeypatch, batch_size, grad_accum, world_size
):
    _check(tmp_path, monkeypatch, batch_size, grad_accum, world_size)


# 4 among 3 ranks, 8 among 3, and 4 among 8 (fewer windows than ranks).
@pytest.mark.parametrize(("batch_size", "grad_accum", "world_size"), [(12, 3, 3), (8, 1, 3), (4, 1, 8)])
def test_a_micro_batch_that_does_not_divide_among_the_ranks_is_refused(
    tmp_path, monkeypatch, batch_size, grad_accum, world_size
):
    micro = batch_size // grad_accum
    with pytest.raises(
        ValueError,
        match=rf"--batch-size {batch_size} with --grad-accum {grad_accum} gives micro-batches of {micro}, "
        rf"which do not divide among {world_size} ranks",
    ):
        _check(tmp_path, monkeypatch, batch_size, grad_accum, world_size)


@pytest.mark.parametrize("progress", [True, False])
def test_train_passes_its_progress_choice_to_the_run(make_config, capsys, progress):
    # tqdm draws "2/2" on stderr once both steps ran; stderr is no terminal here, so only True draws it.
    from tlm_train import train

    train(make_config(steps=2, eval_interval=2, checkpoint_interval=2, sample_tokens=0), progress=progress)
    assert ("2/2" in capsys.readouterr().err) == progress
