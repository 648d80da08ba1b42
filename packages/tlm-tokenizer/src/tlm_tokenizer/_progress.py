"""A tqdm bar imported only when one may show: importing tqdm costs more than a small training run."""

from __future__ import annotations

TYPE_CHECKING = False  # typing itself is not imported: it costs a course-sized training run 10%
if TYPE_CHECKING:
    from typing import Any


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None


def progress_bar(disable: bool | None, **kwargs: Any) -> Any:
    """``tqdm(disable=disable, **kwargs)``, or a do-nothing bar when ``disable is True``."""
    if disable is True:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(disable=disable, **kwargs)
