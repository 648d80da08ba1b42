"""The type checker behind jaxtyping's runtime checks in the test suites (``nox -s tests``).

beartype, with PEP 484's implicit numeric tower: an ``int`` is a valid ``float``, as PEP 484 and mypy
say (``generate(..., temperature=0)``). Plain ``beartype.beartype`` refuses it, which would flag
annotations that are right. Named in ``--jaxtyping-packages=...,tlm_typecheck.typechecker``; the
root pyproject.toml puts tools/ on pytest's ``pythonpath`` so it imports in every test venv.
"""

from beartype import BeartypeConf, beartype

typechecker = beartype(conf=BeartypeConf(is_pep484_tower=True))
