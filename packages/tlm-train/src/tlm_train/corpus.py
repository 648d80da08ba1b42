"""Training data for a run: the default corpus (no download), text files through a tokenizer
trained or loaded here, or a file of token ids; split into training and validation tokens.

What a run derives from text (``tokenizer/``, ``train.npy``, ``val.npy``) is written into the run
directory once, so a resumed run reads exactly the tokens the first one trained on.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tlm_train.atomic import atomic_write, atomic_write_text
from tlm_train.config import TrainConfig

SEPARATOR = "<|endoftext|>"
TOKENIZER_DIR = "tokenizer"
TRAIN_TOKENS, VAL_TOKENS = "train.npy", "val.npy"


def default_corpus() -> str:
    """About 0.5 MB of English prose that every CPython ships: the help topics of ``pydoc``
    (``pydoc_data.topics``), one document per topic, separated by ``<|endoftext|>``."""
    from pydoc_data.topics import topics

    return SEPARATOR.join(topics[name] for name in sorted(topics))


@dataclass
class Dataset:
    train: np.ndarray  # 1-D token ids
    val: np.ndarray
    vocab_size: int
    tokenizer: Any = None  # a tlm_tokenizer.Tokenizer, or None for token-id input


def prepare_data(config: TrainConfig, run_dir: str | os.PathLike[str], *, is_main: bool = True) -> Dataset:
    """The run's tokens. On the main rank this may train a tokenizer and encode text (written into
    ``run_dir``); other ranks call it after a barrier and read what the main rank wrote."""
    run_dir = Path(run_dir)
    if len(config.data) == 1 and _is_token_file(config.data[0]):
        return _token_file(config)
    tokenizer_dir = run_dir / TOKENIZER_DIR
    if is_main and not (run_dir / VAL_TOKENS).exists():
        _encode_text(config, run_dir, tokenizer_dir)
    from tlm_tokenizer import Tokenizer

    tokenizer = Tokenizer.load(tokenizer_dir)
    train = np.load(run_dir / TRAIN_TOKENS, mmap_mode="r")
    val = np.load(run_dir / VAL_TOKENS, mmap_mode="r")
    return Dataset(train, val, _vocab_size(tokenizer), tokenizer)


def _is_token_file(path: str) -> bool:
    return Path(path).suffix in (".npy", ".bin", ".u16", ".u32")


def _token_file(config: TrainConfig) -> Dataset:
    path = Path(config.data[0])
    if not path.is_file():
        raise FileNotFoundError(f"data: no such token file: {path}")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
    else:
        tokens = np.memmap(path, dtype=np.dtype(config.token_dtype).newbyteorder("<"), mode="r")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(f"data: {path} must hold a 1-D array of integer token ids, got {tokens.dtype} {tokens.shape}")
    top = int(tokens.max()) if len(tokens) else 0
    if top >= config.vocab_size:
        raise ValueError(f"data: {path} holds token id {top}, outside vocab_size={config.vocab_size}")
    split = len(tokens) - max(1, round(len(tokens) * config.val_fraction))
    return Dataset(tokens[:split], tokens[split:], config.vocab_size)


def _encode_text(config: TrainConfig, run_dir: Path, tokenizer_dir: Path) -> None:
    from tlm_tokenizer import Tokenizer, train_bpe

    run_dir.mkdir(parents=True, exist_ok=True)
    if config.data:
        for name in config.data:
            if not Path(name).is_file():
                raise FileNotFoundError(f"data: no such text file: {name}")
        texts = [Path(name).read_bytes().decode("utf-8", errors="replace") for name in config.data]
        text = SEPARATOR.join(texts)
    else:
        text = default_corpus()
    corpus = run_dir / "corpus.txt"
    atomic_write(corpus, lambda file: file.write(text.encode("utf-8")))
    if config.tokenizer is not None:
        tokenizer = Tokenizer.load(config.tokenizer)
    else:
        vocab, merges = train_bpe(str(corpus), config.vocab_size, list(config.special_tokens))
        tokenizer = Tokenizer(vocab, merges, special_tokens=list(config.special_tokens))
    tokenizer.save(tokenizer_dir)
    ids = np.asarray(tokenizer.encode(text), dtype=np.uint16 if _vocab_size(tokenizer) <= 2**16 else np.uint32)
    split = len(ids) - max(1, round(len(ids) * config.val_fraction))
    # val.npy last: its presence marks the data as complete.
    atomic_write(run_dir / TRAIN_TOKENS, lambda file: np.save(file, ids[:split]))
    atomic_write(run_dir / VAL_TOKENS, lambda file: np.save(file, ids[split:]))
    corpus.unlink()
    atomic_write_text(run_dir / "data.txt", f"{len(ids)} tokens: {split} train, {len(ids) - split} validation\n")


def _vocab_size(tokenizer: Any) -> int:
    if hasattr(tokenizer, "vocab_size"):
        return int(tokenizer.vocab_size)
    return len(tokenizer.vocab)
