"""``lazy_exports``: names load on first use, and a function named like its submodule stays the function."""

import importlib
import sys
import textwrap

import pytest


@pytest.fixture
def package(tmp_path, monkeypatch):
    root = tmp_path / "lazypkg"
    root.mkdir()
    (root / "__init__.py").write_text(
        textwrap.dedent(
            """
            from tlm_core.lazy import lazy_exports

            lazy_exports(__name__, {"run": "lazypkg.run", "Thing": "lazypkg.things", "gone": "lazypkg.gone"})
            """
        )
    )
    (root / "run.py").write_text("def run():\n    return 'ran'\n")
    (root / "things.py").write_text("import json\n\nclass Thing:\n    pass\n")
    (root / "helper.py").write_text("def helper():\n    return 'helped'\n")  # named like a function, not exported
    (root / "gone.py").write_text("x = 1\n")  # named as the home of an export it does not define
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "lazypkg"
    for name in [m for m in sys.modules if m == "lazypkg" or m.startswith("lazypkg.")]:
        del sys.modules[name]


def test_a_name_loads_its_module_on_first_use_only(package):
    lazypkg = importlib.import_module(package)  # a package made for the test, in tmp_path

    assert "lazypkg.things" not in sys.modules
    assert lazypkg.Thing.__module__ == "lazypkg.things" and "lazypkg.things" in sys.modules
    assert {"run", "Thing"} <= set(dir(lazypkg))
    with pytest.raises(AttributeError, match="module 'lazypkg' has no attribute 'nope'"):
        lazypkg.nope  # noqa: B018


def test_a_function_named_like_its_submodule_stays_the_function_after_the_submodule_is_imported(package):
    importlib.import_module(f"{package}.run")  # binds the submodule on the package, as any direct import does
    run = importlib.import_module(package).run

    assert callable(run) and run() == "ran"
    assert sys.modules["lazypkg.run"].run is run


def test_a_loaded_name_is_kept_on_the_package_and_not_looked_up_again(package, monkeypatch):
    lazypkg = importlib.import_module(package)
    thing = lazypkg.Thing
    assert vars(lazypkg)["Thing"] is thing  # bound on the module: Python finds it without __getattr__
    monkeypatch.setattr(importlib, "import_module", lambda name: pytest.fail(f"imported {name} again"))
    assert lazypkg.Thing is thing


def test_a_submodule_that_is_not_its_names_home_is_bound_as_the_module(package):
    # Only a name whose home is the submodule of that name turns into the function; any other submodule import
    # binds the module itself, as in any package, even one holding a function of its own name.
    importlib.import_module(f"{package}.helper")
    importlib.import_module(f"{package}.things")
    lazypkg = importlib.import_module(package)

    assert lazypkg.helper is sys.modules["lazypkg.helper"] and lazypkg.helper.helper() == "helped"
    assert lazypkg.things is sys.modules["lazypkg.things"]
    assert lazypkg.Thing is lazypkg.things.Thing  # the export still loads from its home
    lazypkg.run = "set by hand"  # a plain assignment is kept as given
    assert lazypkg.run == "set by hand"


def test_a_home_that_lacks_its_export_is_bound_as_the_module_and_the_import_succeeds(package):
    importlib.import_module(f"{package}.gone")  # no error while the import system binds it
    assert importlib.import_module(package).gone is sys.modules["lazypkg.gone"]
