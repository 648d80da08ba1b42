"""tlm_core loads its names lazily (PEP 562): these tests guard that trick and what it saves."""

import subprocess
import sys

import tlm_core


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return set(out.split())


def test_importing_the_checks_loads_neither_the_writers_nor_torch_nor_tqdm():
    loaded = _modules_after("from tlm_core.checks import check_int")
    assert not loaded & {"tlm_core.atomic", "tlm_core.progress", "tlm_core.tensors", "torch", "tqdm", "ctypes"}


def test_every_public_name_resolves_and_is_listed():
    for name in tlm_core.__all__:
        assert getattr(tlm_core, name) is not None
    assert set(tlm_core.__all__) <= set(dir(tlm_core))


def test_the_command_line_helpers_load_no_torch():
    """A library's user error and status line (what tlm-command prints) load no torch."""
    loaded = _modules_after("from tlm_core.cli import UserError, say")
    assert not loaded & {"tlm_core.atomic", "tlm_core.progress", "tlm_core.tensors", "torch", "tqdm"}
