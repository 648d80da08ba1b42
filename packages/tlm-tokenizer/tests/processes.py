"""Child Python processes that run the same tlm-tokenizer as the test (a source tree, a mutant's sandbox)."""

import os
import pathlib

import tlm_core
import tlm_tokenizer


def same_code_env() -> dict[str, str]:
    """os.environ with the folders this process imported tlm_tokenizer and tlm_core from first on PYTHONPATH."""
    roots = [str(pathlib.Path(module.__file__).resolve().parent.parent) for module in (tlm_tokenizer, tlm_core)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
