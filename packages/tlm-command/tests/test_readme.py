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


#: The journey's first line: a fresh clone to a shell where `tlm` and `transformers` run.
SETUP = "python -m pip install nox uv && python -m nox -s dev && . .venv/bin/activate"


@pytest.mark.skipif(not README.is_file(), reason="the tlm monorepo's README.md is not beside this installed copy")
def test_the_journey_starts_with_the_set_up_line_and_it_makes_tlm_and_transformers_available():
    text = README.read_text(encoding="utf-8")
    journey = text.split("## From text to Hugging Face", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", journey, flags=re.DOTALL).group(1)
    lines = block.splitlines()
    assert lines[0] == SETUP
    uses = " ".join(lines[1:])
    assert "tlm " in uses and "transformers" in uses and "pip download" in uses
    # What the line relies on, read from the files it runs (nox -s dev itself takes a minute: it is not run
    # here): the dev session makes .venv/ from every package (tlm-command's `tlm` script among them), the
    # HF references (transformers) and pip (for `pip download`); `tlm` is tlm-command's script.
    root = README.parent
    noxfile = (root / "noxfile.py").read_text(encoding="utf-8")
    dev = noxfile.split("def dev(", 1)[1].split("\n@nox.session", 1)[0]
    assert 'venv = ROOT / ".venv"' in dev and "_workspace_closure()" in dev and "COURSE_REQUIREMENTS" in dev
    assert '"pip"' in dev and re.search(r'COURSE_REQUIREMENTS = \[[^]]*"transformers', noxfile)
    pyproject = (root / "packages" / "tlm-command" / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^\[project\.scripts\]\ntlm = "tlm_command\.main:main"', pyproject, flags=re.M)
