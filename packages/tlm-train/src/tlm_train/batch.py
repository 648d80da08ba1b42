"""Batches of token windows from a 1-D token array (CS336 assignment 1, §5.1).

The array may be a ``np.memmap`` of a token file (uint16 or uint32 ids): only the rows of each
batch are read from it and converted to int64, never the whole file.
"""

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from tlm_core.checks import check_int
from tlm_train.chat_data import split_targets

TokenArray = np.ndarray | Tensor
Batch = tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]


def _check_tokens(dataset: object, context_length: int) -> int:
    """The number of tokens in ``dataset`` after checking it can hold one window of ``context_length + 1``."""
    if isinstance(dataset, np.ndarray):
        integer = np.issubdtype(dataset.dtype, np.integer)
    elif isinstance(dataset, Tensor):
        integer = not (dataset.is_floating_point() or dataset.is_complex() or dataset.dtype == torch.bool)
    else:
        raise TypeError(f"dataset must be a 1-D numpy array or Tensor of token ids, got {type(dataset).__name__}")
    if not integer:
        raise TypeError(f"dataset must hold integer token ids, got dtype {dataset.dtype}")
    if dataset.ndim != 1:
        raise ValueError(f"dataset must be 1-D, got shape {tuple(dataset.shape)}")
    if dataset.shape[0] <= context_length:
        raise ValueError(
            f"dataset must hold more than context_length={context_length} tokens (one window and its "
            f"shifted target), got {dataset.shape[0]}"
        )
    return int(dataset.shape[0])


def windows(dataset: TokenArray, starts: Int[Tensor, " batch"], context_length: int, device: Any) -> Batch:
    """Inputs ``dataset[s : s + context_length]`` and targets one token later, for each start ``s``."""
    offsets = starts.to(torch.int64).unsqueeze(1) + torch.arange(context_length + 1)
    if isinstance(dataset, np.ndarray):
        # Fancy indexing reads only these rows (from disk, for a memmap); then one small int64 copy.
        rows = torch.from_numpy(np.asarray(dataset[offsets.numpy()]).astype(np.int64, copy=False))
    else:
        rows = dataset[offsets.to(dataset.device)].to(torch.int64)
    if torch.device(device).type == "cuda":
        # Pinned host memory and an asynchronous copy: the loop draws the next batch while the GPU works.
        rows = rows.pin_memory().to(device, non_blocking=True)
    else:
        rows = rows.to(device)
    if _masks_targets(dataset):
        # Chat data: a token stored as -1 - id is no target (tlm_train.chat_data), on the device, no host read.
        inputs, targets = split_targets(rows)
        return inputs.contiguous(), targets.contiguous()
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _masks_targets(dataset: TokenArray) -> bool:
    """Whether ``dataset`` may hold masked targets: a signed int32 array (what chat data is stored as)."""
    if isinstance(dataset, np.ndarray):
        return dataset.dtype == np.int32
    return dataset.dtype == torch.int32


def _check_sizes(batch_size: int, context_length: int) -> None:
    check_int("batch_size", batch_size, low=1)
    check_int("context_length", context_length, low=1)


def get_batch(
    dataset: TokenArray,
    batch_size: int,
    context_length: int,
    device: Any,
    generator: torch.Generator | None = None,
) -> Batch:
    """``batch_size`` random windows of ``dataset``: int64 (inputs, targets) on ``device``, each (batch, seq).

    Every start in ``[0, len(dataset) - context_length)`` is equally likely; targets are the
    inputs shifted by one token. Starts come from ``generator`` (a CPU ``torch.Generator``), or from
    torch's global RNG when it is None, so a seeded generator makes the batch sequence reproducible.
    """
    _check_sizes(batch_size, context_length)
    n = _check_tokens(dataset, context_length)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    starts = torch.randint(0, n - context_length, (batch_size,), generator=generator)
    return windows(dataset, starts, context_length, device)


class BatchSampler:
    """An endless, resumable stream of ``get_batch`` batches from a seeded generator.

    ``state_dict()`` holds the generator's state (a uint8 tensor) and the count of batches drawn,
    so a checkpoint that stores it resumes the exact batch sequence. With ``world_size > 1`` every
    rank draws the same global batch of ``batch_size * world_size`` windows and keeps its own
    disjoint slice (``rank`` of them), so ranks never need to communicate to agree. ``rows=True`` draws
    whole rows of ``context_length + 1`` tokens (padded chat examples) instead of windows at any start.
    """

    def __init__(
        self,
        dataset: TokenArray,
        batch_size: int,
        context_length: int,
        device: Any = "cpu",
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        rows: bool = False,
    ) -> None:
        _check_sizes(batch_size, context_length)
        check_int("seed", seed, low=0)
        check_int("world_size", world_size, low=1)
        check_int("rank", rank, low=0)
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
        self._tokens = _check_tokens(dataset, context_length)
        self.dataset, self.batch_size, self.context_length, self.device = dataset, batch_size, context_length, device
        self.rank, self.world_size = rank, world_size
        self.rows = bool(rows)
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0

    def __iter__(self) -> "BatchSampler":
        return self

    def __next__(self) -> Batch:
        draws = (self.batch_size * self.world_size,)
        if self.rows:
            row = self.context_length + 1
            global_starts = torch.randint(0, self._tokens // row, draws, generator=self.generator) * row
        else:
            global_starts = torch.randint(0, self._tokens - self.context_length, draws, generator=self.generator)
        self.batches_drawn += 1
        mine = global_starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return windows(self.dataset, mine, self.context_length, self.device)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != {"generator", "batches_drawn"}:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state must be a dict with keys ['batches_drawn', 'generator'], got {got}")
        generator = state["generator"]
        if not isinstance(generator, Tensor) or generator.dtype != torch.uint8:
            raise TypeError(f"state['generator'] must be a uint8 Tensor (Generator.get_state()), got {generator!r}")
        self.generator.set_state(generator)
        self.batches_drawn = check_int("state['batches_drawn']", state["batches_drawn"], low=0)


class EvalBatches:
    """Fixed windows for evaluation, in order: starts 0, stride, 2·stride, ... (stride defaults to
    ``context_length``: non-overlapping windows that cover the array), ``batch_size`` at a time.

    Iterating twice gives the same batches; ``len()`` is the number of batches (the last may be
    smaller). ``max_batches`` keeps only the first ones; ``windows=k`` keeps k of the n windows evenly spaced
    over the whole array instead (the i-th kept is window ``i·n // k``; all n when k >= n), as the validation
    of a training run and ``tlm eval --val-tokens`` draw them.

    ``score_once=True`` is sliding-window scoring (``tlm eval --stride``): every token after the first is a
    target exactly once, with as much history as its window gives (at least ``context_length - stride``
    tokens once past the first window). A window's targets already scored by the one before are
    ``IGNORE_INDEX``, and a last window ending at the array's end scores the tail that the others do not reach.
    """

    def __init__(
        self,
        dataset: TokenArray,
        batch_size: int,
        context_length: int,
        device: Any = "cpu",
        *,
        stride: int | None = None,
        max_batches: int | None = None,
        windows: int | None = None,
        score_once: bool = False,
    ) -> None:
        _check_sizes(batch_size, context_length)
        n = _check_tokens(dataset, context_length)
        stride = context_length if stride is None else check_int("stride", stride, low=1)
        self.starts = torch.arange(0, n - context_length, stride)
        self.first_scored: Tensor | None = None
        if score_once:
            if stride > context_length:
                raise ValueError(
                    f"stride must be at most context_length={context_length} to score every token, got {stride}"
                )
            if int(self.starts[-1]) + context_length < n - 1:  # the tail the windows miss: one more, at the end
                self.starts = torch.cat([self.starts, torch.tensor([n - 1 - context_length])])
            # Window s has the targets at positions s+1 .. s+context; the ones up to the previous window's last
            # (s_prev + context) are scored already.
            previous_end = torch.cat([torch.zeros(1, dtype=torch.int64), self.starts[:-1] + context_length])
            self.first_scored = (previous_end - self.starts).clamp_min(0)
        if windows is not None:
            check_int("windows", windows, low=1)
            if max_batches is not None or score_once:
                raise ValueError("windows spreads windows over the array: give it without max_batches or score_once")
            n_windows = len(self.starts)
            if windows < n_windows:
                self.starts = self.starts[torch.arange(windows) * n_windows // windows]
        if max_batches is not None:
            self.starts = self.starts[: check_int("max_batches", max_batches, low=1) * batch_size]
            if self.first_scored is not None:
                self.first_scored = self.first_scored[: len(self.starts)]
        self.dataset, self.batch_size, self.context_length, self.device = dataset, batch_size, context_length, device

    def __len__(self) -> int:
        return -(-len(self.starts) // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        if self.first_scored is None:
            for chunk in self.starts.split(self.batch_size):
                yield windows(self.dataset, chunk, self.context_length, self.device)
            return
        from tlm_model.loss import IGNORE_INDEX

        positions = torch.arange(self.context_length)
        for chunk, first in zip(
            self.starts.split(self.batch_size), self.first_scored.split(self.batch_size), strict=True
        ):
            inputs, targets = windows(self.dataset, chunk, self.context_length, self.device)
            seen = (positions < first.unsqueeze(1)).to(targets.device)
            yield inputs, targets.masked_fill(seen, IGNORE_INDEX)
