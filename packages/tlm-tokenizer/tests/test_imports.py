"""tlm_tokenizer loads its names lazily (PEP 562): these tests guard that trick and what it saves.

``from tlm_tokenizer import train_bpe`` must not import the encoder and its file handling
(``tlm_tokenizer.tokenizer``, ``tlm_core.atomic``, ``json``, ``secrets``): those imports took about as
long again as the trainer's own, a sizeable share of a course-sized training run.
"""

import importlib.metadata
import subprocess
import sys

from processes import same_code_env

import tlm_tokenizer


def modules_after(code: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        env=same_code_env(),
    )
    return set(done.stdout.split())


def test_the_trainer_imports_without_the_encoder_and_its_files():
    loaded = modules_after("from tlm_tokenizer import train_bpe")
    assert "tlm_tokenizer.train" in loaded
    assert not loaded & {
        "tlm_tokenizer.tokenizer",
        "tlm_tokenizer._encode_file",
        "tlm_tokenizer.folder",
        "tlm_core.atomic",
        "json",
        "secrets",
        "regex",  # only non-ASCII text needs it
        "tqdm",  # only a bar that shows needs it
    }


def test_the_tokenizer_imports_without_the_trainer_and_file_encoder():
    loaded = modules_after("from tlm_tokenizer import Tokenizer")
    assert "tlm_tokenizer.tokenizer" in loaded
    assert not loaded & {"tlm_tokenizer.train", "tlm_tokenizer._encode_file", "regex", "tqdm", "multiprocessing"}


def test_every_public_name_resolves_and_is_listed():
    for name in tlm_tokenizer.__all__:
        assert getattr(tlm_tokenizer, name) is not None
    assert set(tlm_tokenizer.__all__) <= set(dir(tlm_tokenizer))


def test_version_is_the_installed_distributions():
    assert tlm_tokenizer.__version__ == importlib.metadata.version("tlm-tokenizer")
