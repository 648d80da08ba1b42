"""Optimisation for tlm: AdamW, the warm-up + cosine schedule, and gradient-norm clipping."""

from tlm_optim.adamw import AdamW
from tlm_optim.clip import clip_grad_norm_
from tlm_optim.schedule import CosineSchedule, cosine_lr

__version__ = "0.3.0"

__all__ = ["AdamW", "CosineSchedule", "__version__", "clip_grad_norm_", "cosine_lr"]
