"""The root README's Python examples run as written: each ```python block, from the README's own text."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[3] / "README.md"


def _blocks() -> list[str]:
    if not README.is_file():
        return []
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)


@pytest.mark.skipif(not README.is_file(), reason="the tlm monorepo's README.md is not beside this installed copy")
@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks may write files (a checkpoint folder): into a fresh folder
    exec(compile(_blocks()[index], f"README.md block {index}", "exec"), {"__name__": "readme"})


@pytest.mark.skipif(not README.is_file(), reason="the tlm monorepo's README.md is not beside this installed copy")
def test_the_readme_has_its_examples():
    assert len(_blocks()) >= 3
