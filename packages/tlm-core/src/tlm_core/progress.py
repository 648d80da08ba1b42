"""One progress-bar policy for every tlm command: tqdm on stderr, shown only where someone watches.

``enabled=None`` shows the bar when stderr is a terminal (tqdm's own ``disable=None`` rule), ``True``
always, ``False`` never. tqdm is imported only when a bar may show: importing it costs more than a
small tokenizer run.
"""

from typing import Any

__all__ = ["progress_bar"]


class _NoBar:
    """What :func:`progress_bar` returns when nothing is shown: every tqdm call it gets does nothing."""

    n: float = 0

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        return None

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        return None

    def write(self, text: str) -> None:
        import sys

        print(text, file=sys.stderr)

    def close(self) -> None:
        return None


def progress_bar(enabled: bool | None = None, **kwargs: Any) -> Any:
    """A ``tqdm`` bar on stderr (``kwargs`` go to tqdm: ``total``, ``unit``, ``desc``...), or a bar that
    draws nothing when ``enabled`` is False; ``None`` draws only on a terminal."""
    if enabled is False:
        return _NoBar()
    import sys

    from tqdm.auto import tqdm

    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(disable=None if enabled is None else False, **kwargs)
