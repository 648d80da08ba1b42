"""Check that every workspace package carries what an index page and a user need.

Usage: python tools/check_packaging.py [PACKAGE_DIR ...]   (default: every packages/*/)

For each package: LICENSE identical to the repository's and listed in ``license-files``; the sdist
includes LICENSE and CHANGELOG.md; project URLs Homepage, Repository, Issues and Changelog; a
classifier for each Python version CI runs; a CHANGELOG.md with an entry for the current version;
``__version__`` equal to that version; siblings required with a compatible range that admits their
current version; README links absolute (a relative link breaks on an index page); a package that requires
torch gives PyTorch's CPU-only install line (``CPU_TORCH_LINE``) in its README, so that a CPU machine need not
pull the CUDA build. Exits 1 listing every problem.
"""

import pathlib
import re
import sys

import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
CI_PYTHONS = ["3.11"]  # the versions CI runs (keep in step with the classifiers)
URLS = ["Homepage", "Repository", "Issues", "Changelog"]
CPU_TORCH_LINE = "python -m pip install torch --index-url https://download.pytorch.org/whl/cpu"


def version_of(package_dir: pathlib.Path) -> str:
    pyproject = tomllib.loads((package_dir / "pyproject.toml").read_text())
    path = package_dir / pyproject["tool"]["hatch"]["version"]["path"]
    match = re.search(r'^__version__ = "([^"]+)"', path.read_text(), flags=re.M)
    if match is None:
        raise ValueError(f'{path}: no __version__ = "..." line')
    return match.group(1)


def check(package_dir: pathlib.Path, versions: dict[str, str]) -> list[str]:
    pyproject = tomllib.loads((package_dir / "pyproject.toml").read_text())
    project = pyproject["project"]
    name = project["name"]
    problems = []
    license_file = package_dir / "LICENSE"
    if not license_file.is_file() or license_file.read_text() != (ROOT / "LICENSE").read_text():
        problems.append(f"{name}: LICENSE is missing or differs from the repository's LICENSE")
    if "LICENSE" not in project.get("license-files", []):
        problems.append(f'{name}: [project] needs license-files = ["LICENSE"], so wheels and sdists carry it')
    sdist = pyproject.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {}).get("sdist", {})
    if "include" in sdist:
        missing = {"LICENSE", "CHANGELOG.md"} - set(sdist["include"])
        if missing:
            problems.append(f"{name}: [tool.hatch.build.targets.sdist] include lacks {sorted(missing)}")
    missing_urls = [url for url in URLS if url not in project.get("urls", {})]
    if missing_urls:
        problems.append(f"{name}: [project.urls] lacks {missing_urls}")
    classifiers = project.get("classifiers", [])
    for python in CI_PYTHONS:
        if f"Programming Language :: Python :: {python}" not in classifiers:
            problems.append(f"{name}: no classifier for Python {python}, which CI runs")
    version = versions[name]
    changelog = package_dir / "CHANGELOG.md"
    if not changelog.is_file() or f"## [{version}]" not in changelog.read_text():
        problems.append(f"{name}: CHANGELOG.md has no '## [{version}]' entry for the current version")
    for requirement in project.get("dependencies", []):
        match = re.match(r"(tlm-[a-z0-9-]+)\s*>=\s*([0-9.]+)\s*,\s*<\s*([0-9.]+)\s*$", requirement)
        sibling = re.match(r"tlm-[a-z0-9-]+", requirement)
        if sibling and sibling.group(0) in versions:
            current = tuple(map(int, versions[sibling.group(0)].split(".")))
            if match is None:
                problems.append(f"{name}: sibling requirement {requirement!r} is not a range 'tlm-x>=A,<B'")
            elif not (
                tuple(map(int, match.group(2).split("."))) <= current < tuple(map(int, match.group(3).split(".")))
            ):
                problems.append(
                    f"{name}: {requirement!r} excludes {sibling.group(0)}'s current {versions[sibling.group(0)]}"
                )
    readme = (package_dir / project.get("readme", "README.md")).read_text()
    for target in re.findall(r"\]\(([^)]+)\)", readme):
        if not re.match(r"[a-z][a-z0-9+.-]*:", target) and not target.startswith("#"):
            problems.append(f"{name}: README link {target!r} is relative; it breaks on an index page")
    requires = {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0] for r in project.get("dependencies", [])}
    if "torch" in requires and not re.search(rf"^{re.escape(CPU_TORCH_LINE)}$", readme, flags=re.M):
        problems.append(f"{name}: requires torch, and its README lacks the CPU-only install line {CPU_TORCH_LINE!r}")
    return problems


def main(argv: list[str]) -> int:
    package_dirs = [pathlib.Path(arg).resolve() for arg in argv] or [
        path.parent for path in sorted((ROOT / "packages").glob("*/pyproject.toml"))
    ]
    every = {path.parent for path in (ROOT / "packages").glob("*/pyproject.toml")} | set(package_dirs)
    versions = {tomllib.loads((d / "pyproject.toml").read_text())["project"]["name"]: version_of(d) for d in every}
    problems = [problem for package_dir in package_dirs for problem in check(package_dir, versions)]
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"check_packaging: {len(package_dirs)} packages carry LICENSE, URLs, classifiers and a CHANGELOG")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
