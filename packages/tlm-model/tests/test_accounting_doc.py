import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "make_accounting_doc.py"

pytestmark = pytest.mark.skipif(
    not SCRIPT.exists(), reason="docs/accounting.md lives in the tlm monorepo; this copy has no tools/ or docs/"
)


def test_accounting_doc_is_current():
    spec = importlib.util.spec_from_file_location("make_accounting_doc", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = (ROOT / "docs" / "accounting.md").read_text()
    assert committed == module.render(), "docs/accounting.md is stale: run `nox -s docs`"
    assert (ROOT / "docs" / "accounting_shares.png").exists(), "the plot is missing: run `nox -s docs`"
