"""Training for tlm: batches from token arrays, one optimizer step, evaluation, checkpoints that cannot
be lost, the run folder, and ``train(config)``, the whole run behind ``tlm train`` (one process, or DDP and
FSDP2 under torchrun)."""

from tlm_train.artifacts import Artifact, load_model, load_tokenizer, resolve
from tlm_train.batch import BatchSampler, EvalBatches, get_batch
from tlm_train.checkpoint import (
    Checkpoint,
    CheckpointManager,
    capture_state,
    load_checkpoint,
    load_train_state,
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
from tlm_train.step import LanguageModelLoss, NonFiniteLossError, StepStats, train_step

__version__ = "0.2.1"

__all__ = [
    "Artifact",
    "BatchSampler",
    "Checkpoint",
    "CheckpointManager",
    "DistInfo",
    "EvalBatches",
    "EvalResult",
    "LanguageModelLoss",
    "MetricsLog",
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
    "load_model",
    "load_tokenizer",
    "load_train_state",
    "parameter_groups",
    "plot_loss_curve",
    "read_checkpoint",
    "resolve",
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
