"""Check one installed tlm package in a venv that holds nothing else of ours.

Usage: python check_standalone.py DIST [ALLOWED_SIBLING ...]

Imports the package from site-packages, checks its metadata, version, ``__all__``,
``py.typed`` and that the installed metadata holds the LICENSE (the repository's), checks that
no undeclared sibling is installed, then runs every ```python block of the README that shipped
in the wheel's metadata.
"""

import importlib
import importlib.metadata
import importlib.util
import pathlib
import re
import sys

import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIBLINGS = [tomllib.loads(p.read_text())["project"]["name"] for p in sorted(ROOT.glob("packages/*/pyproject.toml"))]


def module_name(dist: str) -> str:
    return dist.replace("-", "_")


def main(dist: str, allowed: list[str]) -> None:
    module = importlib.import_module(module_name(dist))
    location = pathlib.Path(module.__file__).resolve()
    if "site-packages" not in location.parts:
        sys.exit(f"{dist}: imported from {location}, not from an installed wheel")
    meta = importlib.metadata.metadata(dist)
    if module.__version__ != meta["Version"]:
        sys.exit(f"{dist}: __version__ {module.__version__} != installed metadata {meta['Version']}")
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    if missing:
        sys.exit(f"{dist}: __all__ names missing from the module: {missing}")
    if not (location.parent / "py.typed").exists():
        sys.exit(f"{dist}: the wheel has no py.typed marker")
    # Metadata 2.4 (PEP 639): License-File names a path under the dist-info's licenses/ folder.
    license_files = meta.get_all("License-File") or []
    if "LICENSE" not in license_files:
        sys.exit(f"{dist}: installed metadata lists License-File {license_files}, expected LICENSE among them")
    shipped = importlib.metadata.distribution(dist).read_text("licenses/LICENSE")
    if shipped != (ROOT / "LICENSE").read_text():
        sys.exit(f"{dist}: the installed licenses/LICENSE is missing or differs from the repository's LICENSE")
    for other in SIBLINGS:
        if other != dist and other not in allowed and importlib.util.find_spec(module_name(other)) is not None:
            sys.exit(f"{dist}: {other} is installed too, though {dist} does not declare it")

    readme = meta.get_payload() or meta["Description"] or ""
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    if not blocks:
        sys.exit(f"{dist}: its README has no ```python example")
    for block in blocks:
        exec(compile(block, f"<{dist} README>", "exec"), {})
    print(f"{dist} {meta['Version']}: imports alone (siblings: {allowed or 'none'}), README example ran")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
