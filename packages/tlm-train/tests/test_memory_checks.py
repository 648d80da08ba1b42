"""train_memory's arguments are checked at the boundary: a rank below 0 is no rank."""

import pytest

from tlm_model import PRESETS
from tlm_train import train_memory


def test_ranks_start_at_zero() -> None:
    config = PRESETS["tiny"]
    for rank in (0, 1):
        train_memory(config, world_size=2, rank=rank)
    with pytest.raises(ValueError, match="rank must be >= 0, got -1"):
        train_memory(config, world_size=2, rank=-1)
