"""train_memory against measured tensor bytes: parameters, gradients and AdamW moments summed over the
tensors each rank really holds (1 process; 2 gloo processes with the model wrapped by tlm_train.wrap_model
under DDP and FSDP2, exactly as tlm train wraps it), and the activations autograd really saves
(saved-tensor hooks), with and without activation checkpointing, for the course model and each §7 ablation."""

import dataclasses
import json
import socket
import textwrap

import pytest
import torch
from torch.distributed._composable import checkpoint

from tlm_model import ModelConfig, TransformerLM
from tlm_train.memory import memory_table, shard_rows, train_memory

_SMALL = ModelConfig(vocab_size=77, context_length=16, d_model=48, num_layers=2, num_heads=6, d_ff=64)
CONFIGS = [
    ModelConfig(vocab_size=96, context_length=32, d_model=64, num_layers=2, num_heads=4, d_ff=160),
    ModelConfig(vocab_size=203, context_length=24, d_model=32, num_layers=3, num_heads=2, d_ff=96),
    # Grouped-query attention with a head_dim of its own, and a tied head.
    dataclasses.replace(_SMALL, num_kv_heads=2, head_dim=12, tie_word_embeddings=True),
    ModelConfig(vocab_size=64, context_length=20, d_model=32, num_layers=2, num_heads=4, d_ff=64, rope_layout="half"),
]


def _saved_bytes(model: TransformerLM, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # as get_batch gives them
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(inputs, targets)
    return sum(seen.values())


#: The course architecture ({}) and each §7 ablation, applied to every config.
VARIANTS = [{}, {"norm_placement": "post"}, {"norm_placement": "none"}, {"positions": "none"}, {"ffn": "silu"}]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "course")
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_one_process_matches_measured_bytes(config: ModelConfig, variant: dict, activation_checkpointing: bool) -> None:
    config = dataclasses.replace(config, **variant)
    model = TransformerLM(config, fused=False)
    if activation_checkpointing:
        for block in model.layers:
            checkpoint(block)
    ids = torch.randint(0, config.vocab_size, (3, config.context_length + 1))
    want = train_memory(config, batch_size=3, activation_checkpointing=activation_checkpointing)
    assert want.activations == _saved_bytes(model, ids)
    optimizer = torch.optim.AdamW(model.parameters())
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    optimizer.step()
    assert want.parameters == sum(p.nbytes for p in model.parameters())
    assert want.gradients == sum(p.grad.nbytes for p in model.parameters())
    moments = sum(s[k].nbytes for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert want.optimizer == moments
    assert want.gathered == 0 and (want.recomputed > 0) == activation_checkpointing


def test_shard_rows_cover_every_row_once() -> None:
    for rows in range(1, 40):
        for world in range(1, 7):
            shares = [shard_rows(rows, world, r) for r in range(world)]
            assert sum(shares) == rows and all(s >= 0 for s in shares)


_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from tlm_model import ModelConfig
    from tlm_optim import AdamW
    from tlm_train.distributed import build_model, parameter_groups, wrap_model

    dist.init_process_group("gloo")
    MOMENTS = ("exp_avg", "exp_avg_sq")
    out = []
    for config in map(ModelConfig.from_dict, json.loads(sys.argv[1])):
        measured = {}
        for mode in ("ddp", "fsdp"):
            # What tlm train does: build_model, wrap_model (the loss module under DDP or FSDP2), tlm_optim's
            # AdamW over parameter_groups, one step.
            model = build_model(config, "cpu", seed=0)
            wrapped = wrap_model(model, mode)
            optimizer = AdamW(parameter_groups(model, 0.1))
            ids = torch.randint(0, config.vocab_size, (2, config.context_length + 1))
            wrapped(ids[:, :-1], ids[:, 1:]).backward()
            optimizer.step()
            local = lambda t: t.to_local() if hasattr(t, "to_local") else t
            measured[mode] = {
                "parameters": sum(local(p).nbytes for p in model.parameters()),
                "gradients": sum(local(p.grad).nbytes for p in model.parameters()),
                "optimizer": sum(local(s[k]).nbytes for s in optimizer.state.values() for k in MOMENTS),
            }
        out.append(measured)
    print(json.dumps(out))
    dist.destroy_process_group()
    """
)


@pytest.mark.slow  # two gloo processes (forked from a warm interpreter), every config in one launch
def test_two_ranks_ddp_and_fsdp2_match_measured_bytes(forked) -> None:
    configs = CONFIGS + [dataclasses.replace(CONFIGS[0], **variant) for variant in VARIANTS if variant]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    argv = json.dumps([config.to_dict() for config in configs])
    ranks = [{**base, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(2)]
    procs = [forked(_SCRIPT, argv, wait=False, env=env) for env in ranks]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    for index, config in enumerate(configs):
        for rank, measured in enumerate(results):
            for mode in ("ddp", "fsdp"):
                want = train_memory(config, mode=mode, world_size=2, rank=rank, batch_size=2)
                got = measured[index][mode]
                assert (want.parameters, want.gradients, want.optimizer) == (
                    got["parameters"],
                    got["gradients"],
                    got["optimizer"],
                ), (index, mode, rank)
        # FSDP2 really shards: the two ranks together hold one copy.
        single = train_memory(config, mode="ddp")
        assert results[0][index]["fsdp"]["parameters"] + results[1][index]["fsdp"]["parameters"] == single.parameters


def test_the_table_shows_each_mode_side_by_side() -> None:
    memory = [train_memory(CONFIGS[0], mode=mode, world_size=4) for mode in ("ddp", "fsdp")]
    table = memory_table(memory)
    assert "rank 0 of 4" in table and table.splitlines()[1].split() == ["DDP", "FSDP"]
    assert len(table.splitlines()) == 2 + 6 + 2


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        train_memory(CONFIGS[0], mode="zero")
    with pytest.raises(ValueError, match="rank must be < world_size=2, got 2"):
        train_memory(CONFIGS[0], world_size=2, rank=2)
