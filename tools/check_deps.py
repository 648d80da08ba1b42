"""Compare what each workspace package imports with what its pyproject.toml declares.

Usage: python tools/check_deps.py [PACKAGE_DIR ...]   (default: every packages/*/ with a pyproject.toml)

Imports are read with ``ast`` (every ``import``/``from ... import``, at any depth, including lazy
ones inside functions), reduced to their top-level module, and mapped to a distribution through
``importlib.metadata.packages_distributions()`` of the running environment (workspace packages map
by their own names). Standard-library and relative imports are ignored, and so are the folder's own
modules (a test helper ``tests/helpers.py`` imported as ``helpers``). For each package:

- undeclared: a module imported by ``src/`` that is neither a dependency nor in a non-test extra,
  or one imported by ``tests/`` that is neither a dependency nor in the ``test`` extra;
- unused: a dependency, or a requirement of a non-test extra, that nothing in ``src/`` imports.
  A requirement needed without being imported is listed with its reason in the package's
  pyproject.toml: ``[tool.tlm.check-deps] not-imported = { numpy = "why" }``.
  A distribution that ``src/`` imports only where its absence is handled (an optional feature that
  tells the user what to install), and that cannot be an extra, is listed the same way:
  ``undeclared-imports = { tlm-tokenizer = "why" }``.

Run it in an environment where every package is installed with its extras (``nox -s lint`` does),
so that module names map to the right distributions. Exits 1 listing every problem.
"""

import ast
import importlib.metadata
import pathlib
import re
import sys

import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def canonical(name: str) -> str:
    """PEP 503 normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"cannot read a distribution name from requirement {requirement!r}")
    return canonical(match.group(1))


def imported_modules(folder: pathlib.Path) -> dict[str, str]:
    """Top-level module name -> the first ``file:line`` that imports it, for every .py under ``folder``."""
    found: dict[str, str] = {}
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def module_to_dists(workspace: dict[str, str]) -> dict[str, list[str]]:
    mapping = {
        module: [canonical(dist) for dist in dists]
        for module, dists in importlib.metadata.packages_distributions().items()
    }
    mapping.update({module: [dist] for module, dist in workspace.items()})
    return mapping


def workspace_modules(package_dirs: list[pathlib.Path]) -> dict[str, str]:
    """Import name -> distribution for packages/* and ``package_dirs`` (src layout: src/<module>/)."""
    modules = {}
    for package_dir in {path.parent for path in (ROOT / "packages").glob("*/pyproject.toml")} | set(package_dirs):
        dist = canonical(tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]["name"])
        for module_dir in (package_dir / "src").glob("*/__init__.py"):
            modules[module_dir.parent.name] = dist
    return modules


def check(package_dir: pathlib.Path, dists_of: dict[str, list[str]]) -> list[str]:
    pyproject = tomllib.loads((package_dir / "pyproject.toml").read_text())
    project = pyproject["project"]
    own = canonical(project["name"])
    runtime = {requirement_name(r) for r in project.get("dependencies", [])}
    extras = {
        extra: {requirement_name(r) for r in requirements}
        for extra, requirements in project.get("optional-dependencies", {}).items()
    }
    optional = set().union(*[names for extra, names in extras.items() if extra != "test"])
    test_only = extras.get("test", set())
    settings = pyproject.get("tool", {}).get("tlm", {}).get("check-deps", {})
    reasons = settings.get("not-imported", {})
    undeclared = {canonical(name) for name in settings.get("undeclared-imports", {})}
    problems = []

    def dists_for(module: str) -> list[str]:
        return dists_of.get(module, [canonical(module)])

    src_dists: set[str] = set()
    for folder, allowed, label in (
        (package_dir / "src", runtime | optional | undeclared, "dependencies or a non-test extra"),
        (package_dir / "tests", runtime | test_only, "dependencies or the test extra"),
    ):
        if not folder.is_dir():
            continue
        local = {path.stem for path in folder.glob("*.py")}
        local |= {path.parent.name for path in folder.glob("*/__init__.py")}
        for module, where in sorted(imported_modules(folder).items()):
            if module in sys.stdlib_module_names or module == "__future__" or module in local:
                continue
            dists = dists_for(module)
            if own in dists:
                continue
            if folder.name == "src":
                src_dists.update(dists)
            if not allowed.intersection(dists):
                problems.append(f"{own}: {where} imports {module} (distribution {' or '.join(dists)}), not in {label}")

    for name in sorted((runtime | optional) - src_dists):
        if name in reasons:
            continue
        kind = "dependency" if name in runtime else "optional dependency"
        problems.append(
            f"{own}: {kind} {name} is never imported by src/ (drop it, or give the reason in "
            f'[tool.tlm.check-deps] not-imported = {{ {name} = "..." }})'
        )
    for name in sorted(set(reasons) - runtime - optional):
        problems.append(f"{own}: [tool.tlm.check-deps] not-imported names {name}, which is not a requirement")
    for name in sorted(undeclared - src_dists):
        problems.append(f"{own}: [tool.tlm.check-deps] undeclared-imports names {name}, which src/ never imports")
    return problems


def main(argv: list[str]) -> int:
    package_dirs = [pathlib.Path(arg).resolve() for arg in argv] or [
        path.parent for path in sorted((ROOT / "packages").glob("*/pyproject.toml"))
    ]
    dists_of = module_to_dists(workspace_modules(package_dirs))
    problems = [problem for package_dir in package_dirs for problem in check(package_dir, dists_of)]
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"check_deps: imports match declared requirements in {len(package_dirs)} packages")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
