"""torch.distributed plumbing: start-up from torchrun's environment, building the model on the meta
device and materialising it on each rank, and wrapping it for DDP or FSDP2 (``fully_shard`` per
block, then the root), with optional per-block activation checkpointing."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from tlm_core.checks import check_choice
from tlm_model import ModelConfig, TransformerLM
from tlm_train.cluster import slurm_world
from tlm_train.step import LanguageModelLoss


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "cpu") -> DistInfo:
    """Join the process group that torchrun describes in the environment (``WORLD_SIZE``,
    ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``): gloo on a CPU, nccl on CUDA (one GPU
    per local rank). Under ``srun`` (several tasks, no torchrun), the same variables from SLURM's
    (:func:`tlm_train.cluster.slurm_world`). Without either: one process, no group."""
    os.environ.update(slurm_world())
    if "WORLD_SIZE" not in os.environ:
        return DistInfo(0, 1, 0, torch.device(device))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    target = torch.device(device)
    if target.type == "cuda":
        target = torch.device("cuda", local_rank)
        torch.cuda.set_device(target)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if target.type == "cuda" else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, target)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def build_model(config: ModelConfig, device: torch.device | str, *, seed: int) -> TransformerLM:
    """The model built on the meta device (no memory, no init work) and then materialised on
    ``device`` with ``to_empty`` + ``reset_parameters`` under ``seed``: every rank draws the same
    weights itself, with no broadcast, and a single process draws the same weights too."""
    # Unfused projections: one parameter per course state-dict key, which is what lets
    # torch.distributed.checkpoint name every parameter and its optimizer state.
    model = TransformerLM(config, device="meta", fused=False)
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.reset_parameters()
    return model


def wrap_model(
    model: TransformerLM,
    mode: str = "none",
    *,
    activation_checkpointing: bool = False,
    document_mask_id: int | None = None,
    compile: bool = False,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """The module to train: :class:`LanguageModelLoss` around ``model``, under ``mode``:
    ``"none"`` (one process), ``"ddp"`` (DistributedDataParallel: full replica, gradients
    all-reduced) or ``"fsdp"`` (FSDP2: ``fully_shard`` on each block, then on the root, so each rank
    keeps 1/N of the parameters, gradients and optimizer state). ``model`` keeps its parameters
    (sharded as DTensors under FSDP2), so build the optimizer from it and take state dicts from it.
    ``document_mask_id``: see :class:`LanguageModelLoss`.

    torchtitan's order: activation checkpointing, then ``compile`` (each block, in place, so the
    state-dict keys stay), then sharding. ``param_dtype`` (bfloat16 or float16 training under FSDP2):
    the ``MixedPrecisionPolicy`` that gathers the parameters and runs the blocks in that dtype and
    reduce-scatters the gradients in float32, which also stay float32 in the sharded parameters and the
    optimizer; half the all-gather traffic of float32. Ignored by the other modes.
    """
    check_choice("mode", mode, ("none", "ddp", "fsdp"))
    if mode != "none" and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"distributed mode {mode!r} needs a process group: launch with torchrun (or call "
            f"init_distributed() first); in a single process use mode 'none' (--distributed none)"
        )
    if activation_checkpointing:
        # Recompute each block's activations in the backward pass instead of storing them; the
        # composable API keeps the state-dict keys unchanged.
        for block in model.layers:
            checkpoint_activations(block)
    if compile:
        for block in model.layers:
            block.compile()
    loss_module = LanguageModelLoss(model, document_mask_id=document_mask_id)
    if mode == "ddp":
        device = next(model.parameters()).device
        # Gradients as views into DDP's all-reduce buckets: no second copy of every gradient.
        return DistributedDataParallel(
            loss_module, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
    if mode == "fsdp":
        policy = MixedPrecisionPolicy()
        if param_dtype is not None and param_dtype != torch.float32:
            policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(loss_module, mp_policy=policy)
    return loss_module


def parameter_groups(model: nn.Module, weight_decay: float, *, decay_norms: bool = False) -> list[dict]:
    """AdamW parameter groups: matrices (projections, embeddings) decayed by ``weight_decay``, and 1-D
    parameters (RMSNorm gains) not decayed unless ``decay_norms``: decay pulls a gain towards 0, which
    scales its layer's output down rather than regularising anything (nanoGPT and most LLM recipes
    exempt them). A group with no parameters is left out."""
    matrices = [p for p in model.parameters() if p.requires_grad and (p.ndim >= 2 or decay_norms)]
    vectors = [p for p in model.parameters() if p.requires_grad and p.ndim < 2 and not decay_norms]
    groups = [{"params": matrices, "weight_decay": weight_decay}]
    return groups + ([{"params": vectors, "weight_decay": 0.0}] if vectors else [])
