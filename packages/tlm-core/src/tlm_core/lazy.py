"""A package whose names load on first use (PEP 562), for packages whose modules are costly to import.

``lazy_exports(__name__, {"TransformerLM": "tlm_model.lm", ...})`` at the end of a package's
``__init__`` makes ``from package import TransformerLM`` import ``tlm_model.lm`` then, and not before:
``import package.config`` (a settings dataclass that a command line reads) costs that module alone.

A name that is both a function and the submodule it lives in (``tlm_model.generate``) stays the
function, as an eager ``from tlm_model.generate import generate`` in ``__init__`` leaves it: importing
the submodule binds it on the package, and the package's class turns that binding into the function.
"""

import importlib
import sys
import types
from collections.abc import Mapping


class _LazyPackage(types.ModuleType):
    _homes: Mapping[str, str]

    def __getattr__(self, name: str) -> object:
        home = self.__dict__.get("_homes", {}).get(name)
        if home is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        self.__dict__[name] = value  # later lookups skip this method
        return value

    def __setattr__(self, name: str, value: object) -> None:
        # The import system binds a submodule on its package after loading it; where the package
        # exports a function of that name from it, the package keeps the function.
        homes = self.__dict__.get("_homes", {})
        if isinstance(value, types.ModuleType) and homes.get(name) == value.__name__ and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted({*self.__dict__, *self.__dict__.get("_homes", {})})


def lazy_exports(package: str, homes: Mapping[str, str]) -> None:
    """Make the (already imported) ``package`` load each name of ``homes`` from its module on first use."""
    module = sys.modules[package]
    module.__dict__["_homes"] = dict(homes)
    module.__class__ = _LazyPackage
