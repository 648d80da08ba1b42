"""The parts of a training loop for tlm: batches from token arrays, evaluation, resumable checkpoints."""

from tlm_train.batch import BatchSampler, EvalBatches, get_batch
from tlm_train.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from tlm_train.evaluate import evaluate
from tlm_train.rng import rng_state, set_rng_state

__version__ = "0.1.0"

__all__ = [
    "BatchSampler",
    "EvalBatches",
    "__version__",
    "evaluate",
    "get_batch",
    "load_checkpoint",
    "read_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]
