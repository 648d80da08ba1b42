"""A run's data: the default corpus (no download), text files encoded with the run's tokenizer (trained
here, or given; plain text or JSON Lines, gzip'd or Zstandard-compressed or not: see
:mod:`tlm_train.sources`), or a file of token ids; split into training and validation tokens.

What a run derives from text (``RUN/tokenizer/`` and ``RUN/data/``) is written once, each as one unit,
so a resumed run reads exactly the tokens the first one trained on.
"""

import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tlm_artifacts.layout import RunFolder
from tlm_core.atomic import check_input, create_new, open_input, read_input, remove_leftovers, replace_dir, temp_path
from tlm_train.sources import write_corpus

SEPARATOR = "<|endoftext|>"
TOKEN_SUFFIXES = (".npy", ".bin", ".u16", ".u32")
TRAIN_TOKENS, VAL_TOKENS, INFO = "train.npy", "val.npy", "info.json"
CORPUS = "corpus.txt"  # the tokenizer's training text, under a temporary name while it trains


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    """What a run's data depends on, and nothing else of the run's settings: the ``tlm_train.TrainConfig``
    fields of these names, documented there (``tlm_train.recipe.data_settings`` takes them from one)."""

    data: list[str]
    val_data: list[str]
    text_field: str
    token_dtype: str
    val_fraction: float
    max_data_bytes: int | None
    tokenizer: str | None
    vocab_size: int
    special_tokens: list[str]
    train_on: str
    chat_template: str | None
    chat_layout: str


def default_corpus() -> str:
    """About 0.5 MB of English prose that every CPython ships: the help topics of ``pydoc``
    (``pydoc_data.topics``), one document per topic, separated by ``<|endoftext|>``."""
    from pydoc_data.topics import topics

    return SEPARATOR.join(topics[name] for name in sorted(topics))


@dataclass
class Dataset:
    train: np.ndarray  # 1-D token ids
    val: np.ndarray
    vocab_size: int  # ids lie in [0, vocab_size)
    tokenizer: Any = None  # a tlm_tokenizer.Tokenizer, or None for token ids without one
    rows: bool = False  # padded chat examples: windows are whole rows of context_length + 1 tokens


def is_token_file(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix in TOKEN_SUFFIXES


def check_data_paths(data: list[str], val_data: list[str] | None = None) -> None:
    """What ``--data`` may be, checked before anything is written: existing regular files (not a folder, device
    or FIFO), text or one token file; and ``--val-data``: existing files of the same kind (one token file for
    token data, text or chat otherwise)."""
    for name in val_data or []:
        check_input(name, "--val-data")
    if val_data:
        tokens = data and is_token_file(data[0])
        if tokens and (len(val_data) > 1 or not is_token_file(val_data[0])):
            raise ValueError(f"--val-data must be one token file like --data {data[0]}, got {val_data}")
        if not tokens and any(is_token_file(name) for name in val_data):
            raise ValueError(f"--val-data must be text or chat files like --data, got the token file in {val_data}")
        if not data:
            raise ValueError("--val-data needs --data: the built-in corpus has its own validation split")
    for name in data:
        check_input(name, "--data")
    tokens = [name for name in data if is_token_file(name)]
    if tokens and len(data) > 1:
        raise ValueError(
            f"--data takes text files, or one token-id file ({', '.join(TOKEN_SUFFIXES)}), got {len(tokens)} token "
            f"file(s) among {len(data)}: {data[:3]}"
        )


def prepare_data(
    config: DataSettings,
    run: RunFolder,
    *,
    tokenizer: Any = None,
    is_main: bool = True,
    resume: bool = False,
    context_length: int | None = None,
    vocab_size: int | None = None,
) -> Dataset:
    """The run's tokens. ``tokenizer`` is the one the run must use (from ``--init-from`` or ``--tokenizer``),
    None to train one on text data. On the main rank this may train a tokenizer and encode text into the
    run folder; other ranks call it after a barrier and read what the main rank wrote.

    A token file is read in place, so its identity (size and SHA-256) is recorded in ``RUN/data/info.json``
    at the start and checked on ``resume``: a file changed since is refused (ValueError). Text and chat data are
    encoded into ``RUN/data``, whose token files' identities are recorded beside them and checked at every start.

    Chat data (:mod:`tlm_train.chat_data`) is encoded with the run's chat template into signed arrays that
    carry the target mask; padded examples take rows of ``context_length + 1`` tokens. ``vocab_size`` is the
    ``--init-from`` model's: a token file with no tokenizer is held to it, not to ``--vocab-size``."""
    if config.data and is_token_file(config.data[0]):
        data = _token_file(config, tokenizer, vocab_size)
        if is_main:
            val = Path(config.val_data[0]) if config.val_data else None
            _check_token_file(Path(config.data[0]), run, resume=resume, val_path=val)
        if is_main and tokenizer is not None and not run.has_tokenizer():
            tokenizer.save(run.tokenizer_dir)  # the sample, generate and export decode with it
        return data
    chat = chat_files(config.data, config.text_field)
    if is_main and not (run.data_dir / VAL_TOKENS).is_file():
        try:
            if chat:
                _encode_chat(config, run, tokenizer, context_length)
            else:
                _encode_text(config, run, tokenizer)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
                raise
            raise ValueError(
                f"--out-dir {run.path}: the disk filled while the run's data was written ({err.strerror}); free "
                "space there, or bound the text with --max-data-bytes"
            ) from None
    tokenizer = run.tokenizer()
    for name in (TRAIN_TOKENS, VAL_TOKENS):  # a FIFO or device planted in the run folder is refused, not waited on
        check_input(run.data_dir / name, "run token file")
    if is_main:
        _verify_tokens(run.data_dir)
    train = np.load(run.data_dir / TRAIN_TOKENS, mmap_mode="r")
    val = np.load(run.data_dir / VAL_TOKENS, mmap_mode="r")
    return Dataset(train, val, tokenizer.vocab_size, tokenizer, rows=chat and config.chat_layout == "padded")


def chat_files(data: list[str], text_field: str) -> bool:
    """Whether ``--data`` (the files ``data``) is chat data; refuses a mix of chat and text files."""
    from tlm_train.chat_data import is_chat_file

    kinds = [is_chat_file(path, text_field) for path in data]
    if any(kinds) and not all(kinds):
        chat = [p for p, k in zip(data, kinds, strict=True) if k]
        text = [p for p, k in zip(data, kinds, strict=True) if not k]
        raise ValueError(f"--data mixes chat files ({chat[0]}) and text files ({text[0]}); give one kind")
    return bool(kinds) and all(kinds)


def _encode_chat(config: DataSettings, run: RunFolder, tokenizer: Any, context_length: int | None) -> None:
    from tlm_tokenizer.chat import CHAT_MARKERS, CHATML_TEMPLATE, ChatTemplate, compile_template
    from tlm_train.chat_data import encode_examples, lay_out

    if config.chat_template is None:
        source, markers = CHATML_TEMPLATE, list(CHAT_MARKERS)
    else:
        try:
            source, markers = read_input(config.chat_template, "--chat-template").decode("utf-8"), []
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--chat-template {config.chat_template}: cannot read it ({err})") from None
        compile_template(source)  # a template that does not compile is refused before any work
    run.path.mkdir(parents=True, exist_ok=True)
    tokenizer = _chat_tokenizer(config, run, tokenizer, source, markers)
    if SEPARATOR not in tokenizer.special_tokens:
        raise ValueError(f"chat data needs {SEPARATOR} among the tokenizer's special tokens, to join the examples")
    separator = tokenizer.encode(SEPARATOR)[0]
    template = ChatTemplate(tokenizer, source)
    examples = encode_examples(config.data, template, config.train_on)
    if config.val_data:  # --val-data: conversations of their own
        held_out = encode_examples(config.val_data, template, config.train_on)
        if not examples or not held_out:
            raise ValueError("--data and --val-data must each hold at least one conversation")
    else:
        if len(examples) < 2:
            raise ValueError(
                f"--data holds {len(examples)} conversation(s); a run needs a training and a validation one"
            )
        n_val = min(len(examples) - 1, max(1, round(len(examples) * config.val_fraction)))
        examples, held_out = examples[:-n_val], examples[-n_val:]
    row = (context_length or 0) + 1
    train, cut_train = lay_out(examples, config.chat_layout, separator, row)
    val, cut_val = lay_out(held_out, config.chat_layout, separator, row)
    what = {"completion": "the assistant's", "prompt": "all but the assistant's", "all": "every"}[config.train_on]
    if not _targets(train, config.chat_layout, row):
        raise ValueError(
            f"--data {' '.join(config.data)}: no token of its conversations is a target (--train-on "
            f"{config.train_on} trains on {what} tokens, and they have none within the context): nothing would train"
        )
    if not _targets(val, config.chat_layout, row):
        where = f"--val-data {' '.join(config.val_data)}" if config.val_data else "the validation split of --data"
        raise ValueError(
            f"{where}: no token of its conversations is a target (--train-on {config.train_on} trains on {what} "
            "tokens, and they have none within the context): the validation loss would measure nothing"
        )
    tokenizer.save(run.tokenizer_dir)

    def fill(folder: Path) -> None:
        np.save(folder / TRAIN_TOKENS, train)
        np.save(folder / VAL_TOKENS, val)
        chat = {"examples": len(examples) + len(held_out), "train_on": config.train_on, "layout": config.chat_layout,
                "cut_to_context": cut_train + cut_val}  # fmt: skip
        info = {"tokens": len(train) + len(val), "train": len(train), "val": len(val), "sources": config.data,
                "val_sources": config.val_data, "chat": chat, "files": _identities(folder)}  # fmt: skip
        (folder / INFO).write_text(json.dumps(info) + "\n", encoding="utf-8")

    replace_dir(run.data_dir, fill)


def _chat_tokenizer(config: DataSettings, run: RunFolder, tokenizer: Any, source: str, markers: list[str]) -> Any:
    """The chat run's tokenizer, with the template ``source``: the given one (``tokenizer``, else
    ``--tokenizer``) with the ``markers`` it lacks, else one trained on the conversations as ``source`` renders
    them."""
    from tlm_tokenizer import Tokenizer, train_bpe
    from tlm_tokenizer.chat import compile_template, render_time_limit
    from tlm_train.chat_data import conversations

    if tokenizer is None and config.tokenizer is not None:
        tokenizer = Tokenizer.load(config.tokenizer)
    if tokenizer is not None:
        # A given tokenizer (--tokenizer, --init-from) gains the markers it lacks, as new ids after its own.
        specials = [*tokenizer.special_tokens, *(m for m in markers if m not in tokenizer.special_tokens)]
        return Tokenizer(tokenizer.vocab, tokenizer.merges, specials, chat_template=source)
    # A tokenizer trained on the conversations as the template renders them (its markers are special tokens).
    specials = [*config.special_tokens, *(m for m in markers if m not in config.special_tokens)]
    render = compile_template(source)
    eos = SEPARATOR if SEPARATOR in specials else ""
    remove_leftovers(run.path, CORPUS)
    corpus = temp_path(run.path / CORPUS)
    limit, written = _text_limit(config.max_data_bytes, run), 0
    try:
        with create_new(corpus) as sink:
            for path in config.data:
                for number, messages in conversations(path):
                    with render_time_limit(f"--data {path} line {number}"):
                        text = render(messages=messages, add_generation_prompt=False, bos_token="", eos_token=eos)
                    data = (text + SEPARATOR).encode("utf-8")
                    written += len(data)
                    if written > limit:
                        raise ValueError(
                            f"--data {path}: the corpus passed --max-data-bytes {limit:,} (the conversations as "
                            "the template renders them); raise --max-data-bytes if the disk has room, or give "
                            "less data"
                        )
                    sink.write(data)
        vocab, merges = train_bpe(str(corpus), config.vocab_size, specials, progress=False)
    finally:
        corpus.unlink(missing_ok=True)
    return Tokenizer(vocab, merges, specials, chat_template=source)


def _targets(stored: np.ndarray, layout: str, row: int) -> int:
    """How many tokens of laid-out chat data are targets: stored as ids (not ``-1 - id``) after a window's first."""
    if layout == "padded":
        return int((stored.reshape(-1, row)[:, 1:] >= 0).sum())
    return int((stored[1:] >= 0).sum())


def read_token_file(path: str | os.PathLike[str], token_dtype: str = "uint16") -> np.ndarray:
    """The 1-D integer ids of a token file, memory-mapped: ``.npy`` (no pickles), or raw little-endian
    ``token_dtype`` (``.bin``, ``.u16``, ``.u32``, what ``tlm tokenizer encode`` writes)."""
    path = Path(path)
    check_input(path, "--data")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as err:
            raise ValueError(f"--data {path} is not a readable .npy file: {err}") from None
    else:
        size, width = path.stat().st_size, np.dtype(token_dtype).itemsize
        if size == 0 or size % width:  # numpy's own words name no file ("cannot mmap an empty file")
            raise ValueError(f"--data {path} holds {size} bytes, not a whole, non-zero number of {token_dtype} ids "
                             f"({width} bytes each)")  # fmt: skip
        tokens = np.memmap(path, dtype=np.dtype(token_dtype).newbyteorder("<"), mode="r")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(f"--data {path} must hold a 1-D array of integer token ids, got {tokens.dtype} {tokens.shape}")
    return tokens


def file_identity(path: str | os.PathLike[str], what: str = "--data") -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex digest}`` of a file, read in 1 MiB chunks (a FIFO, device or folder is a
    ``ValueError`` naming ``what`` and the path, never waited on)."""
    digest = hashlib.sha256()
    with open_input(path, what) as file:
        size = 0
        while chunk := file.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _identities(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of the run's token files, recorded in ``info.json`` beside them."""
    return {name: file_identity(folder / name, "run token file") for name in (TRAIN_TOKENS, VAL_TOKENS)}


def _verify_tokens(folder: Path) -> None:
    """The run's token files as ``info.json`` recorded them when they were written (a run that tlm-train 0.2 encoded
    has no record and is read as it is): a flipped bit or a cut file is a ValueError, never trained on."""
    try:
        recorded = json.loads(read_input(folder / INFO, "run data record")).get("files")
    except FileNotFoundError:
        return
    if not isinstance(recorded, dict):
        return
    for name, identity in recorded.items():
        have = file_identity(folder / name, "run token file")
        if have != identity:
            raise ValueError(
                f"{folder / name}: {have['bytes']} bytes, SHA-256 {have['sha256'][:16]}..., but {INFO} recorded "
                f"{identity.get('bytes')} bytes, {str(identity.get('sha256'))[:16]}...: the run's tokens are damaged; "
                f"delete {folder} to encode the data again"
            )


def _check_token_file(path: Path, run: RunFolder, *, resume: bool, val_path: Path | None = None) -> None:
    files = {"token_file": ("--data", path), **({"val_token_file": ("--val-data", val_path)} if val_path else {})}
    identities = {key: {"path": str(p), **file_identity(p, flag)} for key, (flag, p) in files.items()}
    info = run.data_dir / INFO
    if resume and info.is_file():
        try:
            document = json.loads(read_input(info, "run data record"))
            recorded = {
                key: (int(document[key]["bytes"]), str(document[key]["sha256"]))
                for key in identities
                if key == "token_file" or key in document  # a validation file is checked once it was recorded
            }
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"{info} is damaged ({type(err).__name__}: {err}); the run's data cannot be checked"
            ) from None
        for key, have in recorded.items():
            identity = identities[key]
            if have != (identity["bytes"], identity["sha256"]):
                flag, changed = files[key]
                raise ValueError(
                    f"{flag} {changed} changed since the run started ({identity['bytes']} bytes, SHA-256 "
                    f"{identity['sha256'][:16]}..., recorded {have[0]} bytes, {have[1][:16]}...); a resumed run "
                    "trains on the tokens it started with: restore the file, or start a new run"
                )
        return

    def fill(folder: Path) -> None:  # a fresh run, or one that tlm-train 0.2 started without a record
        (folder / INFO).write_text(json.dumps(identities) + "\n", encoding="utf-8")

    replace_dir(run.data_dir, fill)


def _token_file(config: DataSettings, tokenizer: Any, model_vocab: int | None) -> Dataset:
    path = Path(config.data[0])
    tokens = read_token_file(path, config.token_dtype)
    # The ids' range: the tokenizer's, else the --init-from model's (a fine-tune keeps its vocabulary), else the flag.
    vocab = tokenizer.vocab_size if tokenizer is not None else model_vocab or config.vocab_size
    low, top = (int(tokens.min()), int(tokens.max())) if len(tokens) else (0, 0)
    if low < 0 or top >= vocab:
        source = ("the tokenizer's vocabulary" if tokenizer is not None else
                  "the --init-from model's vocabulary" if model_vocab else "--vocab-size")  # fmt: skip
        raise ValueError(f"--data {path} holds token ids in [{low}, {top}], outside [0, {vocab}) ({source})")
    if config.val_data:  # --val-data: a token file of its own, held to the same vocabulary
        val = read_token_file(config.val_data[0], config.token_dtype)
        if len(val) and (int(val.min()) < 0 or int(val.max()) >= vocab):
            raise ValueError(f"--val-data {config.val_data[0]} holds token ids outside [0, {vocab})")
        return Dataset(tokens, val, vocab, tokenizer)
    split = len(tokens) - max(1, round(len(tokens) * config.val_fraction))
    return Dataset(tokens[:split], tokens[split:], vocab, tokenizer)


def _text_limit(max_data_bytes: int | None, run: RunFolder) -> int:
    """The most bytes of text a run writes for its tokenizer and encoder, each corpus file bounded before the disk
    fills: ``--max-data-bytes``, or else half the free space of the run folder's disk (the tokens need room too:
    up to 4 bytes per token, about one per 2-4 bytes of text, until the corpus is removed)."""
    return max_data_bytes if max_data_bytes is not None else shutil.disk_usage(run.path).free // 2


def _encode_text(config: DataSettings, run: RunFolder, tokenizer: Any) -> None:
    from tlm_tokenizer import Tokenizer, encode_file, train_bpe

    run.path.mkdir(parents=True, exist_ok=True)
    if tokenizer is None and config.tokenizer is not None:
        tokenizer = Tokenizer.load(config.tokenizer)
    # Documents are joined by the end-of-text token where the tokenizer has one, in its training text and in
    # what it encodes. The corpus is written once, streamed from the sources (JSON Lines, compressed files),
    # trained on and encoded from the file, so no step holds the whole text in memory.
    specials = tokenizer.special_tokens if tokenizer is not None else list(config.special_tokens)
    separator = SEPARATOR if SEPARATOR in specials else "\n\n"
    # A fresh name created exclusively: a symlink planted in the run folder is never followed.
    remove_leftovers(run.path, CORPUS)  # of a run killed while it trained its tokenizer or encoded
    corpus = temp_path(run.path / CORPUS)
    limit = _text_limit(config.max_data_bytes, run)
    try:
        with create_new(corpus) as sink:
            write_corpus(
                config.data,
                sink,
                separator=separator,
                text_field=config.text_field,
                extra=() if config.data else (default_corpus(),),
                max_bytes=limit,
            )
        if tokenizer is None:
            vocab, merges = train_bpe(str(corpus), config.vocab_size, list(config.special_tokens), progress=False)
            tokenizer = Tokenizer(vocab, merges, special_tokens=list(config.special_tokens))
        tokenizer.save(run.tokenizer_dir)

        def fill(folder: Path) -> None:
            raw = folder / "tokens.raw"
            count = encode_file(tokenizer, corpus, raw, progress=False)
            if count < 4:
                raise ValueError(
                    f"--data holds {count} tokens; a run needs text enough for a training and a validation split"
                )
            ids = np.memmap(raw, dtype=tokenizer.id_dtype, mode="r")
            split = count if config.val_data else count - max(1, round(count * config.val_fraction))
            np.save(folder / TRAIN_TOKENS, ids[:split])
            if not config.val_data:
                np.save(folder / VAL_TOKENS, ids[split:])
            del ids
            raw.unlink()
            val = count - split
            if config.val_data:  # --val-data: its own documents, joined and encoded as the training ones
                held_out = temp_path(run.path / CORPUS)
                try:
                    with create_new(held_out) as sink:
                        write_corpus(config.val_data, sink, separator=separator, text_field=config.text_field,
                                     max_bytes=limit, flag="--val-data")  # fmt: skip
                    val = encode_file(tokenizer, held_out, raw, progress=False)
                finally:
                    held_out.unlink(missing_ok=True)
                np.save(folder / VAL_TOKENS, np.memmap(raw, dtype=tokenizer.id_dtype, mode="r"))
                raw.unlink()
            info = {"tokens": count + val if config.val_data else count, "train": int(split), "val": int(val),
                    "sources": config.data, "val_sources": config.val_data, "files": _identities(folder)}  # fmt: skip
            (folder / INFO).write_text(json.dumps(info) + "\n", encoding="utf-8")

        replace_dir(run.data_dir, fill)
    finally:
        corpus.unlink(missing_ok=True)
