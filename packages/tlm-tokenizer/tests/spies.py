"""Recorders for what encode_file and train_bpe ask of tlm-core's progress bar and of process pools."""

import concurrent.futures
from typing import Any


class RecordingBar:
    """A progress bar that draws nothing and remembers how it was made and how far it went."""

    def __init__(self, enabled: bool | None, **kwargs: Any) -> None:
        self.enabled, self.kwargs, self.n = enabled, kwargs, 0

    def __enter__(self) -> "RecordingBar":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: float = 1) -> None:
        self.n += n


def record_bars_and_pools(monkeypatch, module) -> dict[str, list]:
    """Replace ``module.progress_bar`` and concurrent.futures' ProcessPoolExecutor by recorders (the pools
    still run). Returns ``{"bars": [RecordingBar], "pools": [(max_workers, start method)]}``."""
    record: dict[str, list] = {"bars": [], "pools": []}

    def bar(enabled: bool | None = None, **kwargs: Any) -> RecordingBar:
        record["bars"].append(RecordingBar(enabled, **kwargs))
        return record["bars"][-1]

    class Pool(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, max_workers: int, mp_context: Any = None, **kwargs: Any) -> None:
            record["pools"].append((max_workers, mp_context.get_start_method()))
            super().__init__(max_workers, mp_context=mp_context, **kwargs)

    monkeypatch.setattr(module, "progress_bar", bar)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    return record
