"""jaxtyping's runtime checks for the test suites (``nox -s tests``): the type checker and its pauses.

``typechecker`` is beartype with PEP 484's implicit numeric tower: an ``int`` is a valid ``float``, as
PEP 484 and mypy say (``generate(..., temperature=0)``); plain ``beartype.beartype`` refuses it, which
would flag annotations that are right. It is named in ``--jaxtyping-packages=...,tlm_typecheck.typechecker``;
the root pyproject.toml puts tools/ on pytest's ``pythonpath``, so this module imports in every test venv.

The root conftest.py calls :func:`install` when the checks are on: they then pause while ``torch.compile``
traces (dynamo would trace the checks themselves into the graph and fail on them; eager calls, compiled
modules' eager runs included, stay checked) and inside :class:`Paused` blocks. The pause classes live here,
in an importable module, because dynamo imports the module of any class whose property it traces.
"""

import torch
from beartype import BeartypeConf, beartype
from jaxtyping import config

typechecker = beartype(conf=BeartypeConf(is_pep484_tower=True))


class _Config(type(config)):  # type: ignore[misc]
    """jaxtyping's config, whose ``jaxtyping_disable`` also reads true while torch.compile traces."""

    paused = False

    @property
    def jaxtyping_disable(self) -> bool:
        # jaxtyping's wrapper skips its checks when this is true; under dynamo is_compiling() is a constant.
        return self.paused or torch.compiler.is_compiling()

    @jaxtyping_disable.setter
    def jaxtyping_disable(self, value: bool) -> None:
        self.paused = value


def install() -> None:
    """Make jaxtyping's checks pause while torch.compile traces (idempotent)."""
    if type(config) is not _Config:
        paused = config.__dict__.pop("jaxtyping_disable", False)
        config.__class__ = _Config
        config.paused = paused


class Paused:
    """Wrap a context manager so that jaxtyping's checks are off while it is active."""

    def __init__(self, context):  # type: ignore[no-untyped-def]
        self._context = context

    def __enter__(self):  # type: ignore[no-untyped-def]
        self._previous = config.paused
        config.paused = True
        return self._context.__enter__()

    def __exit__(self, *exc_info):  # type: ignore[no-untyped-def]
        try:
            return self._context.__exit__(*exc_info)
        finally:
            config.paused = self._previous
