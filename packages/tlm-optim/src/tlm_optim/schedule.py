"""The course's learning-rate schedule: linear warm-up, cosine annealing, then a constant floor.

CS336 assignment 1, §4.4: with warm-up ``T_w`` and cosine cycle end ``T_c``,

    t < T_w:           α_t = t / T_w · α_max
    T_w <= t <= T_c:   α_t = α_min + ½ (1 + cos((t − T_w) / (T_c − T_w) · π)) (α_max − α_min)
    t > T_c:           α_t = α_min
"""

import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from tlm_core.checks import check_int, check_number


def _check_schedule(
    max_learning_rate: float, min_learning_rate: float, warmup_iters: int, cosine_cycle_iters: int
) -> None:
    check_number("max_learning_rate", max_learning_rate, low=0.0)
    check_number("min_learning_rate", min_learning_rate, low=0.0)
    check_int("warmup_iters", warmup_iters, low=0)
    check_int("cosine_cycle_iters", cosine_cycle_iters, low=0)
    if cosine_cycle_iters < warmup_iters:
        raise ValueError(f"cosine_cycle_iters must be >= warmup_iters ({warmup_iters}), got {cosine_cycle_iters}")


def cosine_lr(
    t: int, max_learning_rate: float, min_learning_rate: float, warmup_iters: int, cosine_cycle_iters: int
) -> float:
    """The learning rate at iteration ``t`` (0-based) of the course's warm-up + cosine schedule.

    When ``cosine_cycle_iters == warmup_iters`` the cosine segment is the single point ``t = T_w``,
    where the rate is ``max_learning_rate``.
    """
    check_int("t", t, low=0)
    _check_schedule(max_learning_rate, min_learning_rate, warmup_iters, cosine_cycle_iters)
    if t < warmup_iters:
        return t / warmup_iters * max_learning_rate
    if t > cosine_cycle_iters:
        return float(min_learning_rate)
    if cosine_cycle_iters == warmup_iters:
        return float(max_learning_rate)
    progress = (t - warmup_iters) / (cosine_cycle_iters - warmup_iters)
    return min_learning_rate + 0.5 * (1.0 + math.cos(progress * math.pi)) * (max_learning_rate - min_learning_rate)


class CosineSchedule(LRScheduler):
    """Sets every parameter group's ``lr`` to ``cosine_lr(step, ...)``; works with any torch optimizer.

    Call ``scheduler.step()`` after each ``optimizer.step()``, as with torch's schedulers. The
    constructor sets the rate for iteration 0 (0 when there is a warm-up). ``state_dict()`` holds
    only plain numbers, so it survives ``torch.load(weights_only=True)``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_learning_rate: float,
        min_learning_rate: float,
        warmup_iters: int,
        cosine_cycle_iters: int,
        last_epoch: int = -1,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        _check_schedule(max_learning_rate, min_learning_rate, warmup_iters, cosine_cycle_iters)
        self.max_learning_rate = float(max_learning_rate)
        self.min_learning_rate = float(min_learning_rate)
        self.warmup_iters = warmup_iters
        self.cosine_cycle_iters = cosine_cycle_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        lr = cosine_lr(
            max(self.last_epoch, 0),
            self.max_learning_rate,
            self.min_learning_rate,
            self.warmup_iters,
            self.cosine_cycle_iters,
        )
        return [lr for _ in self.optimizer.param_groups]
