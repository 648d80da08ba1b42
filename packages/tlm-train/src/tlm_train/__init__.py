"""The parts of a training loop for tlm: batches from token arrays, evaluation, resumable checkpoints,
and ``train(config)``, the whole run behind ``tlm train`` (one process, or DDP/FSDP2 under torchrun)."""

from tlm_train.batch import BatchSampler, EvalBatches, get_batch
from tlm_train.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint

# The trainer (tlm train): built from the parts above.
from tlm_train.config import TrainConfig
from tlm_train.corpus import default_corpus
from tlm_train.distributed import DistInfo, build_model, init_distributed, wrap_model
from tlm_train.evaluate import evaluate
from tlm_train.metrics import MetricsLog, plot_loss_curve
from tlm_train.rng import rng_state, set_rng_state
from tlm_train.run import RunResult, train
from tlm_train.trainer import (
    CheckpointManager,
    LanguageModelLoss,
    NonFiniteLossError,
    StepStats,
    capture_state,
    evaluate_loss,
    restore_state,
    train_step,
)

__version__ = "0.1.0"

__all__ = [
    "BatchSampler",
    "CheckpointManager",
    "DistInfo",
    "EvalBatches",
    "LanguageModelLoss",
    "MetricsLog",
    "NonFiniteLossError",
    "RunResult",
    "StepStats",
    "TrainConfig",
    "__version__",
    "build_model",
    "capture_state",
    "default_corpus",
    "evaluate",
    "evaluate_loss",
    "get_batch",
    "init_distributed",
    "load_checkpoint",
    "plot_loss_curve",
    "read_checkpoint",
    "restore_state",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "train",
    "train_step",
    "wrap_model",
]
