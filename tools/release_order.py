"""Print the workspace packages one per line, each after the tlm packages it depends on: the order in which
``.github/workflows/release.yml`` publishes them, so that no package reaches the index before a sibling it needs.

Usage: python tools/release_order.py
"""

import pathlib
import re

import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def release_order() -> list[str]:
    requires: dict[str, list[str]] = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        requires[project["name"]] = [_name(r) for r in project.get("dependencies", [])]
    ordered: list[str] = []

    def visit(dist: str, path: tuple[str, ...]) -> None:
        if dist in path:
            raise SystemExit(f"a dependency cycle: {' -> '.join((*path, dist))}")
        for dep in requires[dist]:
            if dep in requires and dep not in ordered:
                visit(dep, (*path, dist))
        if dist not in ordered:
            ordered.append(dist)

    for dist in requires:
        visit(dist, ())
    return ordered


if __name__ == "__main__":
    print("\n".join(release_order()))
