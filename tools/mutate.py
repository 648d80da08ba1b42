"""Mutation testing for the tlm packages: small, realistic code changes that the tests should notice.

Usage (from the repository root, in a venv where the packages are installed editable):

    python tools/mutate.py                                  # the default targets (see DEFAULT_TARGETS)
    python tools/mutate.py --files packages/tlm-norm/src/tlm_norm/rmsnorm.py --max-per-file 40
    python tools/mutate.py --equivalent tools/mutation_equivalent.json --out mutation-report
    # the owning-package measure (issue 44): a sample of the lines changed since a commit, each package's own tests
    python tools/mutate.py --changed-since 72c85d5 --per-package 20 --owning --fast

Each mutant changes one AST node of one source file: a comparison or boolean operator flipped, an
integer constant or slice bound moved by one, ``+``/``-`` or ``*``/``/`` swapped, the operands of a
non-commutative operator swapped, ``True``/``False`` exchanged, a default changed, a condition
negated, ``min``/``max`` exchanged, a ``.float()``-like call removed, or a statement (a ``raise``,
a check, an assignment, a call) replaced by ``pass``. Docstrings, comments, string constants and
type annotations are never mutated; mutants that do not compile or that leave the AST unchanged are
dropped.

Nothing in the working tree is modified: every package's ``src`` is copied to a temporary
directory that goes first on ``PYTHONPATH`` (ahead of the editable installs), and the mutant is
written there; a probe checks that the copy is what gets imported. For each source file the tool
selects its tests (``tests/test_<module>*.py`` of the same package, then every test file in the
workspace that imports the module or a name it defines; ``--tests`` adds more), runs them once
unmutated (the baseline, which must pass and sets the timeout), then once per mutant with
``pytest -x -q -p no:cacheprovider``. A mutant is *killed* when the tests fail, *timeout* when they
run past the limit, *survived* when they pass.

``--changed-since REV`` mutates only the lines of ``packages/*/src`` that ``git diff REV`` adds or changes (the
files follow from it); ``--per-package N`` samples N of a package's mutants (seeded) across its files;
``--owning`` runs every test file of the owning package and no other package's (code that only another package's
tests exercise counts as uncovered; the module's own and importing files first); ``--fast`` leaves out the tests
marked ``slow``.

The report (``<out>.json`` and ``<out>.md``, written atomically) gives killed/survived/timeout per
package and the diff of every survivor. ``--equivalent`` names a JSON file of mutant ids judged
equivalent (id -> reason); those are reported apart and left out of the kill rate.
"""

import argparse
import ast
import copy
import dataclasses
import difflib
import hashlib
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"
DEFAULT_TARGETS = [
    "packages/tlm-linear/src/tlm_linear/*.py",
    "packages/tlm-norm/src/tlm_norm/*.py",
    "packages/tlm-rope/src/tlm_rope/*.py",
    "packages/tlm-ffn/src/tlm_ffn/*.py",
    "packages/tlm-attention/src/tlm_attention/*.py",
    "packages/tlm-model/src/tlm_model/lm.py",
    "packages/tlm-model/src/tlm_model/block.py",
    "packages/tlm-model/src/tlm_model/loss.py",
    "packages/tlm-model/src/tlm_model/generate.py",
]
PYTEST = ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]

_COMPARE_SWAPS: dict[type, list[type]] = {
    ast.Lt: [ast.LtE, ast.GtE],
    ast.LtE: [ast.Lt, ast.Gt],
    ast.Gt: [ast.GtE, ast.LtE],
    ast.GtE: [ast.Gt, ast.Lt],
    ast.Eq: [ast.NotEq],
    ast.NotEq: [ast.Eq],
    ast.Is: [ast.IsNot],
    ast.IsNot: [ast.Is],
    ast.In: [ast.NotIn],
    ast.NotIn: [ast.In],
}
_BINOP_SWAPS: dict[type, list[type]] = {
    ast.Add: [ast.Sub],
    ast.Sub: [ast.Add],
    ast.Mult: [ast.Div],
    ast.Div: [ast.Mult],
    ast.FloorDiv: [ast.Mult],
    ast.Mod: [ast.FloorDiv],
    ast.Pow: [ast.Mult],
    ast.BitOr: [ast.BitAnd],
    ast.BitAnd: [ast.BitOr],
}
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Pow, ast.MatMult, ast.Mod)
# Calls whose removal keeps the program running: casts, copies and layout changes.
_DROPPABLE_METHODS = {"float", "double", "half", "long", "int", "to", "contiguous", "clone", "detach", "t"}
_NAME_SWAPS = {"min": "max", "max": "min", "amax": "amin", "amin": "amax", "maximum": "minimum", "minimum": "maximum"}


@dataclasses.dataclass
class Mutant:
    path: str  # relative to the repository root
    line: int
    operator: str
    start: int  # byte offsets of the replaced span in the original source
    end: int
    replacement: str
    id: str = ""
    status: str = ""  # killed | survived | timeout
    seconds: float = 0.0
    diff: str = ""


def _skip_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: docstrings, annotations, f-strings and everything inside them."""
    skip: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                skip.append(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            skip.append(node.returns)
        if isinstance(node, ast.arg) and node.annotation is not None:
            skip.append(node.annotation)
        if isinstance(node, ast.AnnAssign):
            skip.append(node.annotation)
        if isinstance(node, ast.JoinedStr):
            skip.append(node)
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in ("__all__", "__version__") for t in node.targets
        ):
            skip.append(node)
    return {id(n) for root in skip for n in ast.walk(root)}


def _negated(test: ast.expr) -> ast.expr:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return test.operand
    return ast.UnaryOp(op=ast.Not(), operand=test)


def _candidates(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """(operator name, replacement node) for every mutation of ``node`` itself."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for new in _COMPARE_SWAPS.get(type(op), []):
                mutated = copy.deepcopy(node)
                mutated.ops[i] = new()
                yield f"compare {type(op).__name__}->{new.__name__}", mutated
    elif isinstance(node, ast.BoolOp):
        mutated = copy.deepcopy(node)
        mutated.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield f"boolop {type(node.op).__name__}->{type(mutated.op).__name__}", mutated
        for i in range(len(node.values)):  # drop one operand of and/or
            if len(node.values) > 1:
                rest = [v for j, v in enumerate(node.values) if j != i]
                dropped = rest[0] if len(rest) == 1 else ast.BoolOp(op=node.op, values=rest)
                yield f"boolop drop operand {i}", copy.deepcopy(dropped)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "remove not", copy.deepcopy(node.operand)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        yield "remove unary minus", copy.deepcopy(node.operand)
    elif isinstance(node, ast.BinOp):
        for new in _BINOP_SWAPS.get(type(node.op), []):
            mutated = copy.deepcopy(node)
            mutated.op = new()
            yield f"binop {type(node.op).__name__}->{new.__name__}", mutated
        if isinstance(node.op, _NON_COMMUTATIVE):
            yield "swap operands", ast.BinOp(left=copy.deepcopy(node.right), op=node.op, right=copy.deepcopy(node.left))
    elif isinstance(node, ast.Constant) and not isinstance(node.value, str):
        value = node.value
        if isinstance(value, bool):
            yield f"constant {value}->{not value}", ast.Constant(value=not value)
        elif isinstance(value, int):
            yield "constant +1", ast.Constant(value=value + 1)
            yield "constant -1", ast.Constant(value=value - 1)
        elif isinstance(value, float):
            yield "constant x2", ast.Constant(value=value * 2 if value else 1.0)
            if value:
                yield "constant 0", ast.Constant(value=0.0)
    elif isinstance(node, ast.Slice):
        for bound in ("lower", "upper"):
            expr = getattr(node, bound)
            if expr is not None and not isinstance(expr, ast.Constant):
                for op, sign in (("+1", ast.Add()), ("-1", ast.Sub())):
                    mutated = copy.deepcopy(node)
                    setattr(mutated, bound, ast.BinOp(left=copy.deepcopy(expr), op=sign, right=ast.Constant(1)))
                    yield f"slice {bound} {op}", mutated
    elif isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _DROPPABLE_METHODS:
            yield f"remove .{func.attr}()", copy.deepcopy(func.value)
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name in _NAME_SWAPS:
            mutated = copy.deepcopy(node)
            if isinstance(mutated.func, ast.Attribute):
                mutated.func.attr = _NAME_SWAPS[name]
            else:
                mutated.func.id = _NAME_SWAPS[name]
            yield f"call {name}->{_NAME_SWAPS[name]}", mutated
        for i, kw in enumerate(node.keywords):  # a keyword argument back to the callee's default
            # device= only matters off the CPU, where this tool's runs cannot see it.
            if kw.arg is not None and kw.arg != "device":
                mutated = copy.deepcopy(node)
                del mutated.keywords[i]
                yield f"drop keyword {kw.arg}=", mutated
    elif isinstance(node, (ast.If, ast.While)):
        yield "negate condition", _negated(node.test)


def _statement_drops(node: ast.stmt) -> Iterator[str]:
    if isinstance(node, ast.Raise):
        yield "drop raise"
    elif isinstance(node, ast.If) and not node.orelse and all(isinstance(s, ast.Raise | ast.Return) for s in node.body):
        yield "drop check"
    elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        yield "drop assignment"
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        yield "drop call"


class _Source:
    """A source file with byte offsets for ast's (line, UTF-8 column) positions."""

    def __init__(self, text: str) -> None:
        self.data = text.encode()
        self.line_starts = [0]
        for line in self.data.splitlines(keepends=True):
            self.line_starts.append(self.line_starts[-1] + len(line))

    def offset(self, line: int, col: int) -> int:
        return self.line_starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def replace(self, start: int, end: int, text: str) -> str:
        return (self.data[:start] + text.encode() + self.data[end:]).decode()


def generate_mutants(path: pathlib.Path) -> list[Mutant]:
    """Every mutant of ``path`` that compiles and changes its AST."""
    text = path.read_text()
    tree = ast.parse(text)
    src = _Source(text)
    skip = _skip_nodes(tree)
    original_dump = ast.dump(tree)
    rel = str(path.resolve().relative_to(ROOT))
    out: list[Mutant] = []
    seen: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip or not hasattr(node, "lineno"):
            continue
        edits: list[tuple[str, int, int, str]] = []
        if isinstance(node, (ast.If, ast.While)):
            for name, new_test in _candidates(node):
                start, end = src.span(node.test)
                edits.append((name, start, end, f"({ast.unparse(new_test)})"))
        else:
            for name, new in _candidates(node):
                start, end = src.span(node)
                replacement = ast.unparse(new)
                if not isinstance(node, ast.Slice):
                    replacement = f"({replacement})"
                edits.append((name, start, end, replacement))
        if isinstance(node, ast.stmt):
            for name in _statement_drops(node):
                start, end = src.span(node)
                edits.append((name, start, end, "pass"))
        for name, start, end, replacement in edits:
            mutated = src.replace(start, end, replacement)
            try:
                mutated_tree = ast.parse(mutated)
                compile(mutated_tree, rel, "exec")
            except (SyntaxError, ValueError):
                continue
            dump = ast.dump(mutated_tree)
            if dump == original_dump or dump in seen:
                continue
            seen.add(dump)
            original = src.data[start:end].decode()
            key = f"{rel}\0{name}\0{original}\0{replacement}"
            ident = hashlib.sha1(key.encode()).hexdigest()[:10]
            out.append(Mutant(rel, node.lineno, name, start, end, replacement, id=ident))
    # The same (operator, original, replacement) twice in one file gets distinct ids by order.
    counts: dict[str, int] = {}
    for m in sorted(out, key=lambda m: m.start):
        counts[m.id] = counts.get(m.id, 0) + 1
        if counts[m.id] > 1:
            m.id = f"{m.id}-{counts[m.id]}"
    return sorted(out, key=lambda m: (m.start, m.operator))


def _module_name(path: pathlib.Path) -> tuple[str, str, pathlib.Path]:
    """(package dir name, dotted module name, the package's tests dir) of a src file."""
    rel = path.resolve().relative_to(PACKAGES)
    package_dir, _, *module_parts = rel.parts
    dotted = ".".join(module_parts)[: -len(".py")]
    return package_dir, dotted, PACKAGES / package_dir / "tests"


def _defined_names(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def select_tests(path: pathlib.Path, extra: list[str], exclude: list[str] = (), *, owning: bool = False) -> list[str]:
    """The tests that exercise ``path``, most specific first, less those matching ``exclude`` (with ``owning``,
    every test file of ``path``'s own package and no other's)."""
    _, dotted, tests_dir = _module_name(path)
    top = dotted.split(".")[0]
    stem = path.stem
    chosen = sorted(tests_dir.glob(f"test_{stem}*.py")) if stem != "__init__" else []
    names = _defined_names(path)
    for test in sorted((tests_dir if owning else PACKAGES).glob("test_*.py" if owning else "*/tests/test_*.py")):
        if test in chosen:
            continue
        tree = ast.parse(test.read_text())
        for node in ast.walk(tree):
            hit = False
            if isinstance(node, ast.Import):
                hit = any(a.name == dotted for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                hit = node.module == dotted or (
                    node.module == top and stem != "__init__" and any(a.name in names for a in node.names)
                )
                hit = hit or (stem == "__init__" and node.module == top)
                parent, _, leaf = dotted.rpartition(".")
                hit = hit or (node.module == parent and any(a.name == leaf for a in node.names))  # from pkg import mod
            if hit:
                chosen.append(test)
                break
    if owning:
        # The owning package's tests are all of them (issue 44's reviewer ran each mutant against the package's
        # whole tests folder): a module that only an HTTP test or a command test reaches is covered by those too.
        # The ones named after or importing the module go first, so that ``-x`` stops early on a killed mutant.
        words = {stem, dotted, dotted.rsplit(".", 1)[0]} - {top}
        rest = [t for t in sorted(tests_dir.glob("test_*.py")) if t not in chosen]
        naming = [t for t in rest if any(w in t.read_text() for w in words)]
        chosen += naming + [t for t in rest if t not in naming]
    chosen += [pathlib.Path(p).resolve() for p in extra if pathlib.Path(p).resolve() not in chosen]
    chosen = [p for p in chosen if not any(p.match(pattern) for pattern in exclude)]
    return [str(p.relative_to(ROOT)) for p in chosen]


class Sandbox:
    """Copies of every package's src/<module> in a temporary directory that shadows the installs."""

    def __init__(self) -> None:
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="tlm-mutate-"))
        for src in sorted(PACKAGES.glob("*/src/*")):
            if src.is_dir() and (src / "__init__.py").exists():
                shutil.copytree(src, self.root / src.name, ignore=shutil.ignore_patterns("__pycache__"))
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(self.root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "PYTHONDONTWRITEBYTECODE": "1",  # a pyc from another mutant of the same size and mtime is never reused
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }

    def copy_of(self, rel: str) -> pathlib.Path:
        path = (ROOT / rel).resolve()
        module_dir = path.relative_to(PACKAGES).parts[2:]
        return self.root.joinpath(*module_dir)

    def probe(self, python: str, module: str) -> None:
        where = subprocess.run(
            [python, "-c", f"import {module}; print({module}.__file__)"],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not where.startswith(str(self.root)):
            sys.exit(f"mutate: {module} is imported from {where}, not from the sandbox {self.root}")

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _preload() -> None:
    """Import the heavy third-party modules once, so that each forked run starts warm."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in ("torch", "numpy", "einops", "jaxtyping", "pytest", "hypothesis", "safetensors"):
        try:
            __import__(name)
        except ImportError:
            pass
    leaked = [m for m in sys.modules if m.startswith("tlm_")]
    if leaked:
        sys.exit(f"mutate: {leaked} were imported before forking; they would hide the mutants")


def run_tests_forked(sandbox_root: str, tests: list[str], timeout: float, log: str = os.devnull) -> tuple[str, float]:
    """pytest in a forked child of this (warm) process, with the sandbox first on sys.path and on ``PYTHONPATH`` (for
    the tests' subprocesses); output to ``log``."""
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 3
        try:
            output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(output, 1)
            os.dup2(output, 2)
            os.chdir(ROOT)
            sys.path.insert(0, sandbox_root)
            # A test's own subprocesses (a killed writer, the command line, torchrun) import the mutant too.
            os.environ["PYTHONPATH"] = os.pathsep.join([sandbox_root, *filter(None, [os.environ.get("PYTHONPATH")])])
            os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
            import pytest

            code = int(pytest.main([*PYTEST[2:], *tests]))
        finally:
            os._exit(code)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        elapsed = time.perf_counter() - start
        if done:
            break
        if elapsed > timeout:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return "timeout", elapsed
        time.sleep(0.05)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return "survived", elapsed
    if code == 5:
        raise RuntimeError(f"no tests collected from {tests}")
    return "killed", elapsed


def run_tests(
    python: str, tests: list[str], env: dict[str, str], timeout: float, log: str = os.devnull
) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        with open(log, "w") as output:
            proc = subprocess.run(
                [python, *PYTEST, *tests], env=env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, timeout=timeout
            )
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - start
    elapsed = time.perf_counter() - start
    if proc.returncode == 0:
        return "survived", elapsed
    if proc.returncode == 5:
        raise RuntimeError(f"no tests collected from {tests}")
    return "killed", elapsed


def _write_atomic(path: pathlib.Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def _diff(mutant: Mutant) -> str:
    original = (ROOT / mutant.path).read_text()
    mutated = _Source(original).replace(mutant.start, mutant.end, mutant.replacement)
    lines = difflib.unified_diff(
        original.splitlines(), mutated.splitlines(), mutant.path, f"{mutant.path} (mutant)", n=1, lineterm=""
    )
    return "\n".join(lines)


def changed_lines(rev: str) -> dict[pathlib.Path, set[int]]:
    """The lines of each ``packages/*/src/**.py`` file that ``git diff rev`` adds or changes (numbered as now)."""
    diff = subprocess.run(
        ["git", "diff", "-U0", "--no-color", rev, "--", "packages/*/src/**.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    lines: dict[pathlib.Path, set[int]] = {}
    current: set[int] | None = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            name = line[4:]
            current = None if name == "/dev/null" else lines.setdefault((ROOT / name[2:]).resolve(), set())
        elif line.startswith("@@") and current is not None:
            added = line.split(" ")[2]  # +start[,count]
            start, _, count = added[1:].partition(",")
            current.update(range(int(start), int(start) + int(count or 1)))
    return {path: found for path, found in lines.items() if found and path.exists()}


def _package(rel: str) -> str:
    return pathlib.Path(rel).parts[1]


def summarize(mutants: list[Mutant], equivalent: dict[str, str], meta: dict) -> tuple[dict, str]:
    per_package: dict[str, dict[str, int]] = {}
    for m in mutants:
        row = per_package.setdefault(_package(m.path), {"killed": 0, "survived": 0, "timeout": 0, "equivalent": 0})
        row["equivalent" if m.status == "survived" and m.id in equivalent else m.status] += 1
    for row in per_package.values():
        judged = row["killed"] + row["timeout"] + row["survived"]
        row["total"] = judged + row["equivalent"]
        row["kill_rate"] = round((row["killed"] + row["timeout"]) / judged, 4) if judged else None
    report = {
        **meta,
        "per_package": per_package,
        "mutants": [dataclasses.asdict(m) | {"equivalent": equivalent.get(m.id)} for m in mutants],
    }
    md = ["# Mutation report", ""]
    md += [f"- {k}: {v}" for k, v in meta.items() if k != "files"]
    md += ["", "| package | mutants | killed | timeout | survived | judged equivalent | kill rate (non-equivalent) |"]
    md += ["|---|---|---|---|---|---|---|"]
    totals = {"killed": 0, "survived": 0, "timeout": 0, "equivalent": 0, "total": 0}
    for name, row in sorted(per_package.items()):
        rate = "n/a" if row["kill_rate"] is None else f"{100 * row['kill_rate']:.1f}%"
        md.append(
            f"| {name} | {row['total']} | {row['killed']} | {row['timeout']} | {row['survived']} | "
            f"{row['equivalent']} | {rate} |"
        )
        for k in totals:
            totals[k] += row[k]
    judged = totals["killed"] + totals["timeout"] + totals["survived"]
    rate = f"{100 * (totals['killed'] + totals['timeout']) / judged:.1f}%" if judged else "n/a"
    md.append(
        f"| **all** | {totals['total']} | {totals['killed']} | {totals['timeout']} | {totals['survived']} | "
        f"{totals['equivalent']} | {rate} |"
    )
    for title, want in (("Surviving mutants", False), ("Surviving mutants judged equivalent", True)):
        chosen = [m for m in mutants if m.status == "survived" and (m.id in equivalent) == want]
        md += ["", f"## {title} ({len(chosen)})", ""]
        for m in chosen:
            md.append(f"### `{m.id}` {m.path}:{m.line} ({m.operator})")
            if want:
                md.append(f"\nEquivalent: {equivalent[m.id]}\n")
            md += ["```diff", m.diff, "```", ""]
    return report, "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", help="source files to mutate (default: the six packages' targets)")
    parser.add_argument("--max-per-file", type=int, help="sample at most this many mutants per file (seeded)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--tests", nargs="*", default=[], help="test files run for every source file, in addition")
    parser.add_argument(
        "--exclude",
        nargs="*",
        default=["test_compile.py"],
        help="test-file globs never selected (default: test_compile.py, minutes of torch.compile per run)",
    )
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default: 3 x baseline + 10)")
    parser.add_argument("--equivalent", type=pathlib.Path, help="JSON {mutant id: reason} judged equivalent")
    parser.add_argument("--only", nargs="*", default=[], help="run only these mutant ids")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=ROOT / "build" / "mutation" / "report",
        help="report path stem (.json and .md are added)",
    )
    parser.add_argument("--changed-since", metavar="REV", help="mutate only the src lines changed since REV (git diff)")
    parser.add_argument("--per-package", type=int, help="sample at most this many mutants per package (seeded)")
    parser.add_argument(
        "--owning",
        action="store_true",
        help="run every test file of the owning package and no other's (its own and importing files first)",
    )
    parser.add_argument("--fast", action="store_true", help="leave out the tests marked slow (-m 'not slow')")
    parser.add_argument(
        "--one-baseline",
        action="store_true",
        help="one unmutated run of every selected test, instead of one per source file (its time sets every timeout)",
    )
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs pytest")
    parser.add_argument(
        "--no-fork", action="store_true", help="a fresh interpreter per run instead of forking a warm one (slower)"
    )
    args = parser.parse_args(argv)

    files = [pathlib.Path(f).resolve() for f in args.files] if args.files else []
    changed = changed_lines(args.changed_since) if args.changed_since else None
    if not files:
        files = sorted(changed) if changed is not None else []
        files = files or [p.resolve() for pattern in DEFAULT_TARGETS for p in sorted(ROOT.glob(pattern))]
    files = [f for f in files if f.name != "__init__.py"]  # re-exports only
    equivalent = json.loads(args.equivalent.read_text()) if args.equivalent else {}
    rng = random.Random(args.seed)
    if args.fast:
        PYTEST.extend(["-m", "not slow"])

    generated_in: dict[pathlib.Path, list[Mutant]] = {}
    for path in files:
        mutants = generate_mutants(path)
        if changed is not None:
            mutants = [m for m in mutants if m.line in changed.get(path, set())]
        generated_in[path] = mutants
    if args.per_package is not None and not args.only:  # one seeded sample per package, across its files
        by_package: dict[str, list[Mutant]] = {}
        for mutants in generated_in.values():
            for m in mutants:
                by_package.setdefault(_package(m.path), []).append(m)
        kept = {
            m.id + m.path
            for name in sorted(by_package)
            # A generator per package: a package's sample is the same whichever other packages run with it.
            for m in random.Random(f"{args.seed}:{name}").sample(
                by_package[name], min(args.per_package, len(by_package[name]))
            )
        }
    plan: list[tuple[pathlib.Path, list[str], list[Mutant], int]] = []
    for path in files:
        mutants = generated_in[path]
        generated = len(mutants)
        if args.only:
            mutants = [m for m in mutants if m.id in args.only]
        elif args.per_package is not None:
            mutants = [m for m in mutants if m.id + m.path in kept]
        elif args.max_per_file is not None and len(mutants) > args.max_per_file:
            mutants = sorted(rng.sample(mutants, args.max_per_file), key=lambda m: m.start)
        if mutants:
            plan.append((path, select_tests(path, args.tests, args.exclude, owning=args.owning), mutants, generated))
    if args.list:
        for path, tests, mutants, generated in plan:
            print(f"{path.relative_to(ROOT)}: {len(mutants)} of {generated} mutants; tests: {' '.join(tests)}")
            for m in mutants:
                print(f"  {m.id} line {m.line}: {m.operator}: {m.replacement[:80]}")
        return 0

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - the tool also runs without tqdm
        tqdm = None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_suffix(".partial.jsonl")
    partial.unlink(missing_ok=True)
    sandbox = Sandbox()
    done: list[Mutant] = []
    started = time.time()
    try:
        sandbox.probe(args.python, _module_name(plan[0][0])[1].split(".")[0])
        fork = hasattr(os, "fork") and not args.no_fork and args.python == sys.executable
        if fork:
            _preload()

        def run(tests: list[str], timeout: float, log: str = os.devnull) -> tuple[str, float]:
            if fork:
                return run_tests_forked(str(sandbox.root), tests, timeout, log)
            return run_tests(args.python, tests, sandbox.env, timeout, log)

        total = sum(len(m) for _, _, m, _ in plan)
        bar = tqdm(total=total, unit="mutant", file=sys.stderr) if tqdm else None
        baseline_log = sandbox.root / "baseline.log"

        def baseline_of(tests: list[str], what: str) -> float:
            status, seconds = run(tests, 3600, str(baseline_log))
            if status != "survived":
                # pytest's own summary says which test failed; a stale editable install (whose metadata
                # still names an old version) has been the cause before.
                tail = "\n".join(baseline_log.read_text(errors="replace").splitlines()[-25:])
                sys.exit(f"mutate: the unmutated tests for {what} do not pass ({status}): {' '.join(tests)}\n{tail}")
            return seconds

        union_baseline = None
        if args.one_baseline:  # every file's selection is a subset of the union: one unmutated run vouches for all
            union = list(dict.fromkeys(t for _, tests, _, _ in plan for t in tests))
            union_baseline = baseline_of(union, "these files")
        for path, tests, mutants, _ in plan:
            rel = str(path.relative_to(ROOT))
            copy_path = sandbox.copy_of(rel)
            original = path.read_text()
            baseline = union_baseline if union_baseline is not None else baseline_of(tests, rel)
            timeout = args.timeout or 3 * baseline + 10
            source = _Source(original)
            try:
                for m in mutants:
                    copy_path.write_text(source.replace(m.start, m.end, m.replacement))
                    m.status, m.seconds = run(tests, timeout)
                    m.seconds = round(m.seconds, 2)
                    m.diff = _diff(m)
                    done.append(m)
                    with partial.open("a") as f:  # progress that outlives an interrupted run
                        f.write(json.dumps(dataclasses.asdict(m)) + "\n")
                    if bar:
                        bar.set_postfix_str(f"{pathlib.Path(rel).name}: {m.status}")
                        bar.update()
                    else:
                        print(f"{len(done)}/{total} {rel}:{m.line} {m.operator}: {m.status}", file=sys.stderr)
            finally:
                copy_path.write_text(original)
        if bar:
            bar.close()
    finally:
        sandbox.close()
    meta = {
        "files": [str(p.relative_to(ROOT)) for p, *_ in plan],
        "mutants generated": sum(g for *_, g in plan),
        "mutants run": len(done),
        "sampled": args.max_per_file is not None and any(len(m) < g for _, _, m, g in plan),
        "max per file": args.max_per_file,
        "per package": args.per_package,
        "changed since": args.changed_since,
        "owning package's tests only": args.owning,
        "slow tests left out": args.fast,
        "one baseline": args.one_baseline,
        "seed": args.seed,
        "minutes": round((time.time() - started) / 60, 1),
    }
    report, md = summarize(done, equivalent, meta)
    _write_atomic(args.out.with_suffix(".json"), json.dumps(report, indent=1) + "\n")
    _write_atomic(args.out.with_suffix(".md"), md)
    partial.unlink(missing_ok=True)
    print(md.split("\n## ")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
