"""The command's modules and the experiment tooling's import each other without a cycle (function-level imports
counted too), so each can be read, tested and changed from the bottom up: ``tlm_experiments.sweep`` and
``tlm_experiments.compare`` share ``tlm_experiments.manifest`` instead of importing each other, and the experiment
tooling imports nothing of the command."""

import ast
from pathlib import Path

import tlm_command
import tlm_experiments

PACKAGES = {"tlm_command": Path(tlm_command.__file__).parent, "tlm_experiments": Path(tlm_experiments.__file__).parent}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
        elif isinstance(node, ast.ImportFrom) and node.module in PACKAGES:
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
            found.add(str(node.module))
    return found


def test_the_command_modules_import_each_other_without_a_cycle() -> None:
    graph = {
        f"{package}.{p.stem}": _imports(p)
        for package, folder in PACKAGES.items()
        for p in folder.glob("*.py")
        if p.stem != "__init__"
    }
    assert "tlm_experiments.manifest" in graph["tlm_experiments.compare"] & graph["tlm_experiments.sweep"]
    # the summary's table and plot, imported in a function
    assert "tlm_experiments.compare" in graph["tlm_experiments.sweep"]
    assert not any(m.startswith("tlm_command") for k, v in graph.items() if k.startswith("tlm_experiments") for m in v)
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "an import cycle: " + " -> ".join((*path[path.index(module) :], module))
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())
