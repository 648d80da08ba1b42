"""init_distributed and barrier in this process, under a one-rank torchrun environment (a real gloo group)."""

import pytest
import torch
import torch.distributed as dist

from tlm_model import ModelConfig, TransformerLM
from tlm_train.distributed import DistInfo, barrier, init_distributed, wrap_model


@pytest.fixture
def one_rank_torchrun(monkeypatch):
    # What torchrun --nproc-per-node 1 puts in the environment (a free port: 0 lets the store choose).
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "0")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_under_torchrun_a_cpu_run_joins_a_gloo_group_on_the_cpu(one_rank_torchrun, monkeypatch):
    barriers = []
    real = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: barriers.append(1) or real(*a, **k))
    barrier()  # no group yet: nothing to wait for
    assert barriers == []
    info = init_distributed("cpu")
    assert info == DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    barrier()
    assert barriers == [1]  # a real barrier on the group (one rank: it returns at once)


def _forwards_per_step(module, block) -> int:
    calls = []
    block.register_forward_hook(lambda *args: calls.append(1))
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    module(tokens, tokens).backward()
    return len(calls)


def test_activation_checkpointing_is_off_unless_asked_for():
    # A checkpointed block runs again in the backward pass: its first norm is called a second time (the recompute).
    torch.manual_seed(0)
    plain, checkpointed = (TransformerLM(ModelConfig(50, 8, 16, 1, 2, 32)) for _ in range(2))
    assert _forwards_per_step(wrap_model(plain), plain.layers[0].ln1) == 1
    assert _forwards_per_step(wrap_model(checkpointed, activation_checkpointing=True), checkpointed.layers[0].ln1) == 2
