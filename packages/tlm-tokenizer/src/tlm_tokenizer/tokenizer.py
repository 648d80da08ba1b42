"""A byte-level BPE tokenizer that applies merges by rank exactly as GPT-2 (and tiktoken) do."""

import json
import operator
import os
import re
from collections.abc import Iterable, Iterator
from collections.abc import Set as AbstractSet
from itertools import chain
from pathlib import Path
from typing import Any, Literal, SupportsIndex, cast

from tlm_core.atomic import read_input
from tlm_core.checks import short_repr
from tlm_tokenizer import bpe, hf_json
from tlm_tokenizer._gc import gc_paused
from tlm_tokenizer.folder import read_folder, write_folder
from tlm_tokenizer.gpt2_format import read_gpt2_files
from tlm_tokenizer.pretokenize import LAST_WHITESPACE_CUT, pretokenize, special_splitter

__all__ = ["Tokenizer"]

_STREAM_BLOCK = 1 << 16  # characters gathered before encode_iterable looks for a cut
_ID_LIMIT = 1 << 32  # ids are packed into 32 bits (bpe.pack) and written as uint32 at most (encode_file)
# Capacity of the cache of ids per pre-token. A full cache keeps what it holds and stops adding: on
# natural text the pre-tokens seen first include the frequent ones, so the hit rate stays high without
# the thrashing of clear-or-evict, and memory stays bounded (tens of MB) on a stream of any length.
CACHE_ENTRIES = 1 << 18
# Longer pre-tokens are not cached: they rarely repeat, and 2**18 of them could hold gigabytes.
CACHE_MAX_CHARS = 128
_ALLOWED_SPECIAL = 'allowed_special must be "all", "none" or a set of special tokens'


class Tokenizer:
    """Byte-level BPE: ``encode`` text to ids, ``decode`` ids to text.

    Args:
        vocab: id -> token bytes, ids in [0, 2**32), each byte string once. Must hold all 256 single
            bytes and every merge's two parts and result.
        merges: ``(left, right)`` byte pairs in priority order (rank = position), each pair once.
        special_tokens: strings that are never split; those missing from ``vocab`` get new ids.
            Overlapping ones match longest first.
        chat_template: a Jinja chat template (as transformers' ``tokenizer_config.json`` holds one), saved
            and loaded with the tokenizer; :class:`tlm_tokenizer.chat.ChatTemplate` renders and encodes it.
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: list[tuple[bytes, bytes]],
        special_tokens: list[str] | None = None,
        *,
        chat_template: str | None = None,
    ) -> None:
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
            raise ValueError(f"chat_template must be a non-empty Jinja string or None, got {chat_template!r:.60}")
        self.chat_template = chat_template
        self._vocab = _checked_vocab(vocab)
        self._ids = {token: index for index, token in self._vocab.items()}
        if len(self._ids) != len(self._vocab):
            seen: dict[bytes, int] = {}
            index, twice = next((i, t) for i, t in self._vocab.items() if seen.setdefault(t, i) != i)
            raise ValueError(f"vocab must give each token one id, got {twice!r} at ids {seen[twice]} and {index}")
        missing_bytes = [byte for byte in range(256) if bytes([byte]) not in self._ids]
        if missing_bytes:
            raise ValueError(f"vocab must hold all 256 single bytes, got none for byte {missing_bytes[0]}")
        self.special_tokens = _checked_specials(special_tokens)
        self._merges: list[tuple[bytes, bytes]] = []
        self._merge_table: dict[tuple[int, int], int] = {}
        if isinstance(merges, (str, bytes)) or not isinstance(merges, Iterable):
            raise TypeError(f"merges must be a list of (bytes, bytes) pairs, got {type(merges).__name__}")
        ids, table = self._ids, self._merge_table
        for rank, pair in enumerate(merges):  # GPT-2's 50,000 merges: keep this loop lean
            if not (
                isinstance(pair, (tuple, list))
                and len(pair) == 2
                and isinstance(pair[0], bytes)
                and isinstance(pair[1], bytes)
            ):
                raise TypeError(f"merges must hold (bytes, bytes) pairs, got {short_repr(pair)} at rank {rank}")
            left, right = pair
            first, second, merged = ids.get(left), ids.get(right), ids.get(left + right)
            if first is None or second is None or merged is None:
                lacking = next(part for part in (left, right, left + right) if part not in ids)
                raise ValueError(f"merges[{rank}] {(left, right)!r} needs {lacking!r}, which vocab lacks")
            key = (first, second)
            if key in table:
                raise ValueError(
                    f"merges must hold each pair once, got {(left, right)!r} at ranks {table[key] >> 32} and {rank}"
                )
            table[key] = bpe.pack(rank, merged)
            self._merges.append((left, right))
        for token in self.special_tokens:
            encoded = token.encode("utf-8")
            if encoded not in self._ids:
                index = max(self._vocab) + 1
                if index >= _ID_LIMIT:
                    raise ValueError(f"special_tokens: no id below 2**32 is left for {token!r}")
                self._vocab[index] = encoded
                self._ids[encoded] = index
        self._special_ids = {token: self._ids[token.encode("utf-8")] for token in self.special_tokens}
        # Read once per generated token by a server's text stream: kept, not a max over the vocabulary each time.
        self._vocab_size = max(self._vocab) + 1
        self._splitter = special_splitter(self.special_tokens)
        self._splitters: dict[frozenset[str], re.Pattern[str] | None] = {}  # per allowed_special set
        self._longest_special = max(map(len, self.special_tokens), default=0)
        self._byte_ids = [self._ids[bytes([byte])] for byte in range(256)]
        self._cache: dict[str, tuple[int, ...]] = {}  # pre-token -> its ids
        self._rank_order: Any = False  # built on the first very long pre-token (None: the table does not allow it)

    # -- files ----------------------------------------------------------------------------------

    @classmethod
    def from_files(
        cls,
        vocab_filepath: str | os.PathLike[str],
        merges_filepath: str | os.PathLike[str],
        special_tokens: list[str] | None = None,
    ) -> "Tokenizer":
        """Load GPT-2-format ``vocab.json`` and ``merges.txt`` (GPT-2's own files included)."""
        vocab, merges = read_gpt2_files(vocab_filepath, merges_filepath)
        return cls(vocab, merges, special_tokens)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (:meth:`hf_files`) into ``directory``.

        The folder is replaced as one unit: a reader, or a process killed at any moment, finds the old
        tokenizer or the new one. Refuses (ValueError) a folder that holds files other than a
        tokenizer's, so that saving into the wrong place never deletes them.
        """
        write_folder(directory, self.hf_files())

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> "Tokenizer":
        """Load a folder written by :meth:`save` (or by HF, see :meth:`from_hf`): its ``tokenizer.json``."""
        folder = Path(directory)
        data = read_folder(folder).get(hf_json.TOKENIZER_JSON)
        if data is None:
            raise FileNotFoundError(f"directory must hold tokenizer.json, got {folder} without it")
        tokenizer = cls._from_hf_bytes(data, str(folder / hf_json.TOKENIZER_JSON))
        try:  # its chat template, when tokenizer_config.json has one
            config = read_folder(folder, (hf_json.TOKENIZER_CONFIG_JSON,)).get(hf_json.TOKENIZER_CONFIG_JSON)
        except FileNotFoundError:
            config = None
        tokenizer.chat_template = _chat_template(config, folder)
        return tokenizer

    @classmethod
    def from_hf(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Load an HF ``tokenizer.json`` (the file, or a folder holding it), whoever wrote it.

        Accepts exactly the tokenizers tlm reproduces: byte-level BPE with GPT-2's pre-tokenization
        pattern, no normalizer, no dropout, unknown token, subword prefix or suffix, a byte-level
        decoder. Anything else raises ValueError naming what differs.
        """
        source = Path(path)
        if source.is_dir():
            data = read_folder(source, (hf_json.TOKENIZER_JSON,)).get(hf_json.TOKENIZER_JSON)
            source = source / hf_json.TOKENIZER_JSON
            if data is None:
                raise FileNotFoundError(f"path must be a tokenizer.json or a folder holding one, got {source.parent}")
        else:
            data = read_input(source, "tokenizer")
        tokenizer = cls._from_hf_bytes(data, str(source))
        # Its chat template: transformers 5 writes chat_template.jinja, earlier ones tokenizer_config.json's field.
        jinja = source.parent / "chat_template.jinja"
        if jinja.exists():
            text = read_input(jinja, "chat template")
            try:
                tokenizer.chat_template = text.decode("utf-8") or None
            except UnicodeDecodeError as err:
                raise ValueError(f"chat template {jinja}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        elif (source.parent / hf_json.TOKENIZER_CONFIG_JSON).exists():
            config = read_input(source.parent / hf_json.TOKENIZER_CONFIG_JSON, "tokenizer config")
            tokenizer.chat_template = _chat_template(config, source.parent)
        return tokenizer

    @classmethod
    def _from_hf_bytes(cls, data: bytes, where: str) -> "Tokenizer":
        """The tokenizer of the ``tokenizer.json`` bytes ``data`` read from ``where``: a file that does not make a
        valid tokenizer raises ValueError naming it, in one line."""
        vocab, merges, special_tokens = hf_json.from_json(data, where)
        try:
            return cls(vocab, merges, special_tokens)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from None

    def hf_files(self) -> dict[str, bytes]:
        """The files of an HF tokenizer folder, name -> bytes: ``tokenizer.json`` (HF tokenizers' format)
        and ``tokenizer_config.json`` (so that ``transformers.AutoTokenizer`` loads it as it is)."""
        return {
            hf_json.TOKENIZER_JSON: hf_json.to_json(self._vocab, self._merges, self.special_tokens),
            hf_json.TOKENIZER_CONFIG_JSON: hf_json.config_json(self.special_tokens, self.chat_template),
        }

    # -- views ----------------------------------------------------------------------------------

    @property
    def vocab(self) -> dict[int, bytes]:
        """A copy of id -> token bytes (special tokens included)."""
        return dict(self._vocab)

    @property
    def merges(self) -> list[tuple[bytes, bytes]]:
        """A copy of the merges, in rank order."""
        return list(self._merges)

    @property
    def vocab_size(self) -> int:
        """One more than the largest id: the size an embedding table needs."""
        return self._vocab_size

    def __len__(self) -> int:
        return len(self._vocab)

    # -- encoding -------------------------------------------------------------------------------

    def _bpe(self, token: bytes) -> list[int]:
        """GPT-2's rule: repeatedly merge the adjacent pair of lowest rank, leftmost on ties (``bpe.merge``)."""
        if len(token) == 1:
            return [self._byte_ids[token[0]]]
        parts = list(map(self._byte_ids.__getitem__, token))
        if len(token) >= bpe.RANK_ORDER_MIN:  # a line without whitespace: whole-array steps, one per rank
            if self._rank_order is False:
                from tlm_tokenizer._rank_order import RankOrderMerge  # numpy, imported only when needed

                self._rank_order = RankOrderMerge.build(self._merge_table, self._byte_ids)
            if self._rank_order is not None:
                return cast(list[int], self._rank_order(parts))
        return bpe.merge(parts, self._merge_table)

    def _encode_ordinary(self, text: str) -> list[int]:
        """Ids of ``text`` (no special tokens in it): BPE once per distinct pre-token, then a cache.

        The ids come out of the cache's tuples through ``chain`` and ``map``, so a cached text costs
        C-speed work only: one run of the pattern, one dict lookup per pre-token.
        """
        pretokens = pretokenize(text)
        cache = self._cache
        try:  # every pre-token seen before: no set to build (on new text the first miss comes early)
            return list(chain.from_iterable(map(cache.__getitem__, pretokens)))
        except KeyError:
            pass
        with gc_paused():  # BPE's many short-lived lists and tuples form no cycles
            new = {token: tuple(self._bpe(token.encode("utf-8"))) for token in set(pretokens).difference(cache)}
        room = CACHE_ENTRIES - len(cache)
        kept = [token for token in new if len(token) <= CACHE_MAX_CHARS][:room]
        if len(kept) == len(new):
            cache.update(new)
            return list(chain.from_iterable(map(cache.__getitem__, pretokens)))
        # The cache keeps what it holds plus what fits; this call alone sees the rest.
        cache.update((token, new[token]) for token in kept)
        lookup = {token: cache[token] for token in set(pretokens).difference(new)}
        lookup.update(new)
        return list(chain.from_iterable(map(lookup.__getitem__, pretokens)))

    def encode(self, text: str, allowed_special: Literal["all", "none"] | AbstractSet[str] = "all") -> list[int]:
        """Token ids of ``text``; the special tokens that ``allowed_special`` allows are matched first and never
        split, the others are encoded as the ordinary text they are.

        ``allowed_special`` is tiktoken's control: ``"all"`` (the default: every special token), ``"none"`` (text
        is only ever text: what a server does with what a user typed, so that no one can type a control token)
        or a set of this tokenizer's special tokens. Unlike tiktoken, text that holds a special token not allowed
        is never an error: it is encoded as text (tiktoken's ``disallowed_special=()``).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        splitter = self._splitter_for(allowed_special)
        if splitter is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        for position, part in enumerate(splitter.split(text)):
            if position % 2:
                ids.append(self._special_ids[part])
            elif part:
                ids += self._encode_ordinary(part)
        return ids

    def _splitter_for(self, allowed_special: object) -> re.Pattern[str] | None:
        if isinstance(allowed_special, str):
            if allowed_special == "all":
                return self._splitter
            if allowed_special == "none":
                return None
            raise ValueError(f"{_ALLOWED_SPECIAL}, got {allowed_special!r}")
        if not isinstance(allowed_special, AbstractSet):
            raise TypeError(f"{_ALLOWED_SPECIAL}, got {type(allowed_special).__name__}")
        allowed = frozenset(allowed_special)
        if unknown := sorted(map(repr, allowed.difference(self._special_ids))):
            raise ValueError(f"allowed_special holds tokens that are not special tokens here: {', '.join(unknown[:5])}")
        if allowed == frozenset(self.special_tokens):
            return self._splitter
        if allowed not in self._splitters:
            self._splitters[allowed] = special_splitter(allowed)
        return self._splitters[allowed]

    def _stream_cut(self, buffer: str) -> int:
        """Largest p such that encode(buffer[:p]) + encode(rest) == encode(buffer + rest) for any rest."""
        limit = len(buffer) - self._longest_special
        if limit <= 0:
            return 0
        match = LAST_WHITESPACE_CUT.match(buffer, 0, limit + 1)
        cut = match.end() if match is not None else 0
        if self._splitter is not None:
            best_end = 0
            for special in self._splitter.finditer(buffer):
                if special.start() > limit:
                    break
                if special.start() < cut < special.end():
                    cut = special.start()
                if special.end() <= limit:
                    best_end = special.end()
            cut = max(cut, best_end)
        return cut

    def encode_blocks(self, iterable: Iterable[str]) -> Iterator[list[int]]:
        """Like ``encode_iterable``, but yields lists of ids, one per block of about 64K characters."""
        if isinstance(iterable, str):
            iterable = (iterable,)
        buffer = ""
        for item in iterable:
            if not isinstance(item, str):
                raise TypeError(f"iterable must yield str, got {type(item).__name__} ({short_repr(item)})")
            buffer += item
            if len(buffer) < _STREAM_BLOCK:
                continue
            cut = self._stream_cut(buffer)
            if cut > 0:
                yield self.encode(buffer[:cut])
                buffer = buffer[cut:]
        if buffer:
            yield self.encode(buffer)

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Lazily yield the ids of the concatenation of ``iterable`` (e.g. a file's lines).

        Equals ``encode("".join(iterable))``. Memory stays bounded: the caches have a fixed capacity, and
        text is held in blocks of about 64K characters plus one item (longer only where the text runs
        that long without ASCII whitespace).
        """
        for ids in self.encode_blocks(iterable):
            yield from ids

    # -- decoding -------------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[SupportsIndex]) -> bytes:
        """The bytes that ``ids`` stand for: ints (numpy's integers too; bools and floats are refused)."""
        try:
            return b"".join(map(self._vocab.__getitem__, _checked_ids(ids)))
        except KeyError as missing:
            raise ValueError(f"ids must be in the vocabulary, got {missing.args[0]!r}") from None

    def decode(self, ids: Iterable[SupportsIndex]) -> str:
        """Text of ``ids``; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # -- files ----------------------------------------------------------------------------------

    @property
    def id_dtype(self) -> str:
        """``"uint16"`` when every id fits in 16 bits, else ``"uint32"``: what ``encode_file`` writes."""
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    def __getstate__(self) -> dict[str, Any]:
        return {
            "vocab": self._vocab,
            "merges": self._merges,
            "special_tokens": self.special_tokens,
            "chat_template": self.chat_template,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["vocab"], state["merges"], state["special_tokens"], chat_template=state.get("chat_template")
        )


def _checked_vocab(vocab: object) -> dict[int, bytes]:
    """A copy of ``vocab`` if it maps ints in [0, 2**32) (not bools) to bytes."""
    if not isinstance(vocab, dict):
        raise TypeError(f"vocab must be a dict of int id -> bytes, got {type(vocab).__name__}")
    if not (set(map(type, vocab)) <= {int} and set(map(type, vocab.values())) <= {bytes}):  # the fast check
        for index, token in vocab.items():
            if isinstance(index, bool) or not isinstance(index, int) or not isinstance(token, bytes):
                raise TypeError(f"vocab must map int ids to bytes, got {short_repr(index)} -> {short_repr(token)}")
        vocab = {int(index): bytes(token) for index, token in vocab.items()}  # subclasses of int or bytes
    if vocab and (min(vocab) < 0 or max(vocab) >= _ID_LIMIT):
        raise ValueError(f"vocab ids must lie in [0, 2**32), got {min(vocab) if min(vocab) < 0 else max(vocab)}")
    return dict(vocab)


def _checked_specials(special_tokens: object) -> list[str]:
    """``special_tokens`` as a list without repeats, if it is None or an iterable of non-empty str."""
    if special_tokens is None:
        return []
    if isinstance(special_tokens, str) or not isinstance(special_tokens, Iterable):
        raise TypeError(f"special_tokens must be a list of non-empty str or None, got {type(special_tokens).__name__}")
    specials = list(special_tokens)
    bad = next((token for token in specials if not isinstance(token, str) or not token), None)
    if bad is not None:
        raise TypeError(f"special_tokens must hold non-empty str, got {short_repr(bad)}")
    return list(dict.fromkeys(specials))


def _checked_ids(ids: Iterable[SupportsIndex]) -> Iterable[int]:
    """``ids`` (as a list or tuple) if every one is an int; an integer of another kind (numpy's) is
    converted; a bool, a float or anything else raises TypeError."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"ids must be an iterable of int, got {type(ids).__name__}")
    if not isinstance(ids, (list, tuple)):
        ids = list(ids)
    if set(map(type, ids)) <= {int}:
        return cast(list[int], ids)
    for position, value in enumerate(ids):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError(f"ids must be ints, got {type(value).__name__} {short_repr(value)} at position {position}")
    return list(map(operator.index, ids))


def _chat_template(config: bytes | None, folder: Path) -> str | None:
    """The ``chat_template`` string of a ``tokenizer_config.json`` (None without one)."""
    if config is None:
        return None
    try:
        document = json.loads(config)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{folder / hf_json.TOKENIZER_CONFIG_JSON}: not JSON ({err})") from None
    template = document.get("chat_template") if isinstance(document, dict) else None
    return template if isinstance(template, str) and template.strip() else None
