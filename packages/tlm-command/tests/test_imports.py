"""No import circle anywhere in the workspace: every module of every package (``packages/*/src``) imports the
others without a cycle, counting the imports deferred into function bodies and those under ``TYPE_CHECKING``
(a deferred import only postpones a loop; it does not remove it). So each module can be read, tested and changed
from the bottom up: ``tlm_artifacts.lora`` handles adapter files and never opens an artifact (the base of an
adapter is opened beside ``resolve``), and ``tlm_experiments.sweep`` and ``.compare`` share ``.manifest`` instead
of importing each other."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(
    not (ROOT / "packages").is_dir(), reason="reads every package's source: the tlm monorepo only"
)


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> its file, for every ``packages/*/src`` of the workspace at ``root``."""
    found = {}
    for src in sorted(root.glob("packages/*/src")):
        for path in sorted(src.rglob("*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The workspace modules ``name`` imports, at any depth: ``from pkg import mod`` names ``pkg.mod`` when that
    is a module, else ``pkg`` itself (its ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    found.add(f"{base}.{alias.name}")
                elif base in known:
                    found.add(base)
    return found - {name}


def graph(root: pathlib.Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(edges.get(module, ())):
            if (found := visit(imported, [*path, module])) is not None:
                return found
        done.add(module)
        return None

    for module in sorted(edges):
        if (found := visit(module, [])) is not None:
            return found
    return None


def test_no_module_of_any_package_is_in_an_import_cycle() -> None:
    edges = graph(ROOT)
    assert len({name.split(".")[0] for name in edges}) >= 14  # every package's source was read
    found = cycle(edges)
    assert found is None, "an import cycle: " + " -> ".join(found or [])


def test_the_cycle_finder_finds_a_cycle_deferred_into_a_function(tmp_path) -> None:
    src = tmp_path / "packages" / "tlm-x" / "src" / "tlm_x"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "a.py").write_text("from tlm_x.b import f\n")
    (src / "b.py").write_text("def f():\n    from tlm_x import a\n")
    (src / "c.py").write_text("from . import b\n")
    assert graph(tmp_path)["tlm_x.c"] == {"tlm_x.b"}
    assert cycle(graph(tmp_path)) == ["tlm_x.a", "tlm_x.b", "tlm_x.a"]
    (src / "b.py").write_text("def f():\n    pass\n")
    assert cycle(graph(tmp_path)) is None


def test_adapter_files_and_experiments_import_nothing_above_them() -> None:
    edges = graph(ROOT)
    assert not edges["tlm_artifacts.lora"] & {"tlm_artifacts.artifact", "tlm_artifacts.steps", "tlm_artifacts"}
    assert not edges["tlm_artifacts.layout"] & {"tlm_artifacts.steps", "tlm_artifacts.artifact"}
    assert "tlm_experiments.manifest" in edges["tlm_experiments.compare"] & edges["tlm_experiments.sweep"]
    experiments = {n: e for n, e in edges.items() if n.startswith("tlm_experiments")}
    assert not {m for e in experiments.values() for m in e if m.startswith("tlm_command")}


def test_only_tlm_command_parses_a_command_line() -> None:
    """The libraries take plain values (a notebook calls ``tlm_experiments.sweep.run(SweepOptions(...))``);
    every flag, its parser and its help live in tlm-command."""
    parsing = sorted(
        name
        for name, path in modules(ROOT).items()
        if not name.startswith(("tlm_command", "tlm."))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and "argparse" in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module])
    )
    assert parsing == []


def _declared(package_dir: pathlib.Path) -> set[str]:
    """The tlm packages a ``pyproject.toml`` lists under ``dependencies`` (not its extras), by short name."""
    import re

    tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")
    project = tomllib.loads((package_dir / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = (re.match(r"[A-Za-z0-9_.-]+", d).group(0) for d in project.get("dependencies", []))  # type: ignore[union-attr]
    return {n.removeprefix("tlm-") for n in names if n.startswith("tlm-")}


def test_the_package_table_is_the_import_graph() -> None:
    """ARCHITECTURE.md's table of who imports whom is what the sources import and what each pyproject declares."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    table = text.split("<!-- package-table -->")[1].split("<!-- /package-table -->")[0]
    drawn = {}
    for row in table.strip().splitlines()[2:]:
        package, uses = (cell.strip() for cell in row.strip("|").split("|"))
        drawn[package.removeprefix("tlm-")] = set() if uses == "(none)" else {u.strip() for u in uses.split(",")}
    imported: dict[str, set[str]] = {}
    for module, targets in graph(ROOT).items():
        home = module.split(".")[0].removeprefix("tlm_").replace("_", "-")
        if home == "tlm":  # the ``tlm`` entry point package of tlm-command
            home = "command"
        imported.setdefault(home, set()).update(
            t.split(".")[0].removeprefix("tlm_").replace("_", "-") for t in targets if t.split(".")[0] != "tlm"
        )
    imported = {package: uses - {package} for package, uses in imported.items()}
    packages = {p.parent.name.removeprefix("tlm-") for p in ROOT.glob("packages/*/pyproject.toml")}
    assert set(drawn) == packages == set(imported)
    assert imported == drawn
    assert {p: _declared(ROOT / "packages" / f"tlm-{p}") for p in packages} == drawn
