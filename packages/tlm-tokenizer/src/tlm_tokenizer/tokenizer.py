"""A byte-level BPE tokenizer that applies merges by rank exactly as GPT-2 (and tiktoken) do."""

import json
import os
import pathlib
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any, cast

from tlm_core.atomic import replace_dir
from tlm_tokenizer import bpe
from tlm_tokenizer._gc import gc_paused
from tlm_tokenizer.gpt2_format import read_gpt2_files, write_gpt2_files
from tlm_tokenizer.pretokenize import LAST_WHITESPACE_CUT, pretokenize, special_splitter

__all__ = ["Tokenizer"]

SPECIAL_TOKENS_FILE = "special_tokens.json"
_STREAM_BLOCK = 1 << 16  # characters gathered before encode_iterable looks for a cut
# Capacity of the cache of ids per pre-token. A full cache keeps what it holds and stops adding: on
# natural text the pre-tokens seen first include the frequent ones, so the hit rate stays high without
# the thrashing of clear-or-evict, and memory stays bounded (tens of MB) on a stream of any length.
CACHE_ENTRIES = 1 << 18
# Longer pre-tokens are not cached: they rarely repeat, and 2**18 of them could hold gigabytes.
CACHE_MAX_CHARS = 128


class Tokenizer:
    """Byte-level BPE: ``encode`` text to ids, ``decode`` ids to text.

    Args:
        vocab: id -> token bytes. Must hold all 256 single bytes and every merge's two parts and result.
        merges: ``(left, right)`` byte pairs in priority order (rank = position).
        special_tokens: strings that are never split; those missing from ``vocab`` get new ids.
            Overlapping ones match longest first.
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: list[tuple[bytes, bytes]],
        special_tokens: list[str] | None = None,
    ) -> None:
        if not isinstance(vocab, dict):
            raise TypeError(f"vocab: expected a dict[int, bytes], got {type(vocab).__name__}")
        bad = next(((i, t) for i, t in vocab.items() if not isinstance(i, int) or not isinstance(t, bytes)), None)
        if bad is not None:
            raise TypeError(f"vocab: expected int -> bytes entries, got {bad[0]!r} -> {bad[1]!r}")
        if special_tokens is not None and (
            isinstance(special_tokens, str) or not all(isinstance(s, str) and s for s in special_tokens)
        ):
            raise TypeError(f"special_tokens: expected a list of non-empty str or None, got {special_tokens!r}")
        self._vocab = dict(vocab)
        self._ids = {token: index for index, token in self._vocab.items()}
        missing_bytes = [byte for byte in range(256) if bytes([byte]) not in self._ids]
        if missing_bytes:
            raise ValueError(f"vocab: expected all 256 single bytes, got none for byte {missing_bytes[0]}")
        self._merges = cast(list[tuple[bytes, bytes]], [tuple(pair) for pair in merges])
        self._merge_table: dict[tuple[int, int], int] = {}
        for rank, pair in enumerate(self._merges):
            if len(pair) != 2 or not all(isinstance(part, bytes) for part in pair):
                raise TypeError(f"merges: expected (bytes, bytes) pairs, got {pair!r} at position {rank}")
            for part in (*pair, pair[0] + pair[1]):
                if part not in self._ids:
                    raise ValueError(f"merges: merge {rank} {pair!r} needs {part!r}, which vocab lacks")
            key = (self._ids[pair[0]], self._ids[pair[1]])
            if key not in self._merge_table:
                self._merge_table[key] = bpe.pack(rank, self._ids[pair[0] + pair[1]])
        self.special_tokens = list(dict.fromkeys(special_tokens or []))
        for token in self.special_tokens:
            encoded = token.encode("utf-8")
            if encoded not in self._ids:
                index = max(self._vocab, default=-1) + 1
                self._vocab[index] = encoded
                self._ids[encoded] = index
        self._special_ids = {token: self._ids[token.encode("utf-8")] for token in self.special_tokens}
        self._splitter = special_splitter(self.special_tokens)
        self._longest_special = max(map(len, self.special_tokens), default=0)
        self._byte_ids = [self._ids[bytes([byte])] for byte in range(256)]
        self._cache: dict[str, tuple[int, ...]] = {}  # pre-token -> its ids

    # -- construction from and to files ---------------------------------------------------------

    @classmethod
    def from_files(
        cls,
        vocab_filepath: str | os.PathLike,
        merges_filepath: str | os.PathLike,
        special_tokens: list[str] | None = None,
    ) -> "Tokenizer":
        """Load GPT-2-format ``vocab.json`` and ``merges.txt`` (GPT-2's own files included)."""
        vocab, merges = read_gpt2_files(vocab_filepath, merges_filepath)
        return cls(vocab, merges, special_tokens)

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``vocab.json``, ``merges.txt`` and ``special_tokens.json`` into ``directory``, all or nothing."""

        def fill(folder: pathlib.Path) -> None:
            write_gpt2_files(folder, self._vocab, self._merges)
            payload = {"special_tokens": self.special_tokens}
            (folder / SPECIAL_TOKENS_FILE).write_text(json.dumps(payload, ensure_ascii=False) + "\n", encoding="utf-8")

        replace_dir(directory, fill)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Load a directory written by ``save``."""
        folder = pathlib.Path(directory)
        if not folder.is_dir():
            raise FileNotFoundError(f"directory: expected a tokenizer directory, got {folder} (no such directory)")
        special_tokens: list[str] = []
        specials_path = folder / SPECIAL_TOKENS_FILE
        if specials_path.exists():
            special_tokens = json.loads(specials_path.read_text(encoding="utf-8"))["special_tokens"]
        return cls.from_files(folder / "vocab.json", folder / "merges.txt", special_tokens)

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
        return max(self._vocab) + 1

    def __len__(self) -> int:
        return len(self._vocab)

    # -- encoding -------------------------------------------------------------------------------

    def _bpe(self, token: bytes) -> list[int]:
        """GPT-2's rule: repeatedly merge the adjacent pair of lowest rank, leftmost on ties (``bpe.merge``)."""
        if len(token) == 1:
            return [self._byte_ids[token[0]]]
        return bpe.merge(list(map(self._byte_ids.__getitem__, token)), self._merge_table)

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

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens are matched first and never split."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        if self._splitter is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        for position, part in enumerate(self._splitter.split(text)):
            if position % 2:
                ids.append(self._special_ids[part])
            elif part:
                ids += self._encode_ordinary(part)
        return ids

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
                raise TypeError(f"iterable: expected str items, got {type(item).__name__}")
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

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes that ``ids`` stand for."""
        try:
            return b"".join(map(self._vocab.__getitem__, ids))
        except KeyError as missing:
            raise ValueError(f"ids: expected ids in the vocabulary, got {missing.args[0]!r}") from None
        except TypeError:
            raise TypeError(f"ids: expected an iterable of int, got {type(ids).__name__}") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # -- files ----------------------------------------------------------------------------------

    @property
    def id_dtype(self) -> str:
        """``"uint16"`` when every id fits in 16 bits, else ``"uint32"``: what ``encode_file`` writes."""
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    def encode_file(
        self,
        path: str | os.PathLike,
        out_path: str | os.PathLike,
        num_workers: int = 1,
        progress: bool | None = None,
    ) -> int:
        """Encode a UTF-8 file into a raw little-endian array of ``id_dtype``; returns the token count.

        See ``tlm_tokenizer.encode_file`` (the function).
        """
        from tlm_tokenizer._encode_file import encode_file

        return encode_file(self, path, out_path, num_workers=num_workers, progress=progress)

    def __getstate__(self) -> dict[str, Any]:
        return {"vocab": self._vocab, "merges": self._merges, "special_tokens": self.special_tokens}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["vocab"], state["merges"], state["special_tokens"])  # type: ignore[misc]
