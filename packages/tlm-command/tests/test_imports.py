"""The command's modules import each other without a cycle (function-level imports counted too), so each
can be read, tested and changed from the bottom up: ``tlm_command.sweep`` and ``tlm_command.compare`` share
``tlm_command.manifest`` instead of importing each other."""

import ast
from pathlib import Path

import tlm_command

PACKAGE = Path(tlm_command.__file__).parent


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tlm_command.")}
        elif isinstance(node, ast.ImportFrom) and node.module == "tlm_command":
            found |= {f"tlm_command.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tlm_command."):
            found.add(str(node.module))
    return found


def test_the_command_modules_import_each_other_without_a_cycle() -> None:
    graph = {f"tlm_command.{p.stem}": _imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert "tlm_command.manifest" in graph["tlm_command.compare"] & graph["tlm_command.sweep"]
    assert "tlm_command.compare" in graph["tlm_command.sweep"]  # the summary's table and plot, imported in a function
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
