"""Training for tlm: batches from token arrays, one optimizer step, evaluation, checkpoints that cannot
be lost, the run folder, and ``train(config)``, the whole run behind ``tlm train`` (one process, or DDP and
FSDP2 under torchrun).

Names load on first use (PEP 562): ``from tlm_train.config import TrainConfig`` imports the settings
alone, with no torch, which ``tlm train`` relies on to check its flags before torch loads.
"""

from typing import TYPE_CHECKING

from tlm_core.lazy import lazy_exports

__version__ = "0.3.0"

_HOMES = {
    "BatchSampler": "tlm_train.batch",
    "EvalBatches": "tlm_train.batch",
    "get_batch": "tlm_train.batch",
    "Checkpoint": "tlm_train.checkpoint",
    "CheckpointManager": "tlm_train.checkpoint",
    "capture_state": "tlm_train.checkpoint",
    "load_checkpoint": "tlm_train.checkpoint",
    "read_checkpoint": "tlm_train.checkpoint",
    "restore_state": "tlm_train.checkpoint",
    "save_checkpoint": "tlm_train.checkpoint",
    "save_train_state": "tlm_train.checkpoint",
    "TrainConfig": "tlm_train.config",
    "default_corpus": "tlm_train.data",
    "DistInfo": "tlm_train.distributed",
    "build_model": "tlm_train.distributed",
    "init_distributed": "tlm_train.distributed",
    "parameter_groups": "tlm_train.distributed",
    "wrap_model": "tlm_train.distributed",
    "EvalResult": "tlm_train.evaluate",
    "evaluate": "tlm_train.evaluate",
    "TrainMemory": "tlm_train.memory",
    "train_memory": "tlm_train.memory",
    "MetricsLog": "tlm_train.metrics",
    "plot_loss_curve": "tlm_train.metrics",
    "Recipe": "tlm_train.recipe",
    "ResumeError": "tlm_train.recipe",
    "RunResult": "tlm_train.recipe",
    "train": "tlm_train.recipe",
    "rng_state": "tlm_train.rng",
    "seed_everything": "tlm_train.rng",
    "set_rng_state": "tlm_train.rng",
    "RunDir": "tlm_train.run_dir",
    "RunInUseError": "tlm_train.run_dir",
    "LanguageModelLoss": "tlm_train.step",
    "NonFiniteGuard": "tlm_train.step",
    "NonFiniteLossError": "tlm_train.step",
    "StepStats": "tlm_train.step",
    "train_step": "tlm_train.step",
}

__all__ = [
    "BatchSampler",
    "Checkpoint",
    "CheckpointManager",
    "DistInfo",
    "EvalBatches",
    "EvalResult",
    "LanguageModelLoss",
    "MetricsLog",
    "NonFiniteGuard",
    "NonFiniteLossError",
    "Recipe",
    "ResumeError",
    "RunDir",
    "RunInUseError",
    "RunResult",
    "StepStats",
    "TrainConfig",
    "TrainMemory",
    "__version__",
    "build_model",
    "capture_state",
    "default_corpus",
    "evaluate",
    "get_batch",
    "init_distributed",
    "load_checkpoint",
    "parameter_groups",
    "plot_loss_curve",
    "read_checkpoint",
    "restore_state",
    "rng_state",
    "save_checkpoint",
    "save_train_state",
    "seed_everything",
    "set_rng_state",
    "train",
    "train_memory",
    "train_step",
    "wrap_model",
]

if TYPE_CHECKING:
    from tlm_train.batch import BatchSampler, EvalBatches, get_batch
    from tlm_train.checkpoint import (
        Checkpoint,
        CheckpointManager,
        capture_state,
        load_checkpoint,
        read_checkpoint,
        restore_state,
        save_checkpoint,
        save_train_state,
    )
    from tlm_train.config import TrainConfig
    from tlm_train.data import default_corpus
    from tlm_train.distributed import DistInfo, build_model, init_distributed, parameter_groups, wrap_model
    from tlm_train.evaluate import EvalResult, evaluate
    from tlm_train.memory import TrainMemory, train_memory
    from tlm_train.metrics import MetricsLog, plot_loss_curve
    from tlm_train.recipe import Recipe, ResumeError, RunResult, train
    from tlm_train.rng import rng_state, seed_everything, set_rng_state
    from tlm_train.run_dir import RunDir, RunInUseError
    from tlm_train.step import LanguageModelLoss, NonFiniteGuard, NonFiniteLossError, StepStats, train_step


lazy_exports(__name__, _HOMES)
