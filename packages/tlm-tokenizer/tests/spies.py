"""Recorders for what encode_file and train_bpe ask of tlm-core's progress bar and of process pools."""

import concurrent.futures
from typing import Any

from tlm_core.progress import progress_bar


def record_bars_and_pools(monkeypatch, module) -> dict[str, list]:
    """Replace ``module.progress_bar`` and concurrent.futures' ProcessPoolExecutor by recorders (the pools
    still run). Returns ``{"bars": [bar], "pools": [(max_workers, start method)]}``, each bar tlm-core's bar that draws
    nothing (it counts ``n``) with the ``enabled`` and ``kwargs`` it was asked for."""
    record: dict[str, list] = {"bars": [], "pools": []}

    def bar(enabled: bool | None = None, **kwargs: Any) -> Any:
        made = progress_bar(False)
        made.enabled, made.kwargs = enabled, kwargs
        record["bars"].append(made)
        return made

    class Pool(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, max_workers: int, mp_context: Any = None, **kwargs: Any) -> None:
            record["pools"].append((max_workers, mp_context.get_start_method()))
            super().__init__(max_workers, mp_context=mp_context, **kwargs)

    monkeypatch.setattr(module, "progress_bar", bar)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    return record
