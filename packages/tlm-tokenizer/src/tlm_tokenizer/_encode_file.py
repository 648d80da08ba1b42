"""Encode a text file into a flat array of token ids for training, optionally across processes.

The output is raw little-endian ``uint16`` (vocabularies up to 65,536 ids) or ``uint32``, with no
header (no numpy here to write a ``.npy``): read it with
``numpy.memmap(out_path, dtype=tokenizer.id_dtype, mode="r")``.
"""

import array
import codecs
import os
import pathlib
import shutil
import sys
from collections.abc import Iterator
from typing import BinaryIO

from tlm_core.atomic import atomic_file, check_input, open_input, remove_leftovers, temp_path
from tlm_core.checks import check_positive_int
from tlm_core.progress import progress_bar
from tlm_tokenizer._chunks import split_file
from tlm_tokenizer.tokenizer import Tokenizer

__all__ = ["encode_file"]

_READ_BYTES = 1 << 20
_RANGE_BYTES = 32 << 20  # ranges smaller than this would not amortise a worker's start-up; more give progress
_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _text_blocks(path: str, start: int, end: int) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open_input(path, "path") as handle:
        handle.seek(start)
        left = end - start
        while left > 0:
            data = handle.read(min(_READ_BYTES, left))
            if not data:
                break
            left -= len(data)
            yield decoder.decode(data, final=left == 0)


def _encode_range(tokenizer: Tokenizer, path: str, start: int, end: int, part_path: str) -> int:
    typecode = "H" if tokenizer.id_dtype == "uint16" else "I"
    count = 0
    with open(part_path, "wb") as out:
        ids = array.array(typecode)
        for block in tokenizer.encode_blocks(_text_blocks(path, start, end)):
            ids.extend(block)
            if len(ids) >= _READ_BYTES:
                count += _flush(ids, out)
                ids = array.array(typecode)
        count += _flush(ids, out)
    return count


def _flush(ids: array.array, out: BinaryIO) -> int:
    if sys.byteorder != "little":
        ids.byteswap()
    ids.tofile(out)
    return len(ids)


def _encode_range_in_worker(path: str, start: int, end: int, part_path: str) -> int:
    assert _worker_tokenizer is not None
    return _encode_range(_worker_tokenizer, path, start, end, part_path)


def encode_file(
    tokenizer: Tokenizer,
    path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    num_workers: int = 1,
    progress: bool | None = None,
) -> int:
    """Encode the UTF-8 file ``path`` to ``out_path`` (raw little-endian ``tokenizer.id_dtype``).

    The file is cut into byte ranges at points no pre-token or special token crosses, so the result
    equals ``tokenizer.encode`` of the whole text whatever ``num_workers`` is. ``out_path`` is written
    all or nothing (the temporary files of a run that was killed are removed by the next one). A tqdm
    bar (in bytes) shows when stderr is a terminal, unless ``progress=False``.

    Returns:
        The number of token ids written.
    """
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a Tokenizer, got {type(tokenizer).__name__}")
    check_positive_int("num_workers", num_workers)
    source = os.fspath(path)
    check_input(source, "path")  # missing: FileNotFoundError; a FIFO, device or folder: ValueError, never waited on
    size = os.path.getsize(source)
    target = pathlib.Path(out_path)
    if target.is_dir():
        raise IsADirectoryError(f"out_path must be a file path, got the folder {target}")
    parts = max(num_workers, -(-size // _RANGE_BYTES)) if num_workers > 1 else 1
    ranges = split_file(source, parts, tokenizer.special_tokens)
    remove_leftovers(target.parent, target.name)
    scratch = temp_path(target)  # a folder of one file per range; removed by remove_leftovers if killed
    scratch.mkdir()
    try:
        part_paths = [str(scratch / f"{index:06d}") for index in range(len(ranges))]
        total = 0
        with progress_bar(progress, total=size, unit="B", unit_scale=True, desc="encoding") as bar:
            jobs = [(source, start, end, part) for (start, end), part in zip(ranges, part_paths, strict=True)]
            if num_workers == 1 or len(ranges) == 1:
                for (start, end), job in zip(ranges, jobs, strict=True):
                    total += _encode_range(tokenizer, *job)
                    bar.update(end - start)
            else:
                import multiprocessing  # here, not at the top: importing it slows every short run
                from concurrent.futures import ProcessPoolExecutor

                context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
                with ProcessPoolExecutor(
                    min(num_workers, len(ranges)), mp_context=context, initializer=_init_worker, initargs=(tokenizer,)
                ) as pool:
                    for (start, end), count in zip(
                        ranges, pool.map(_encode_range_in_worker, *zip(*jobs, strict=True)), strict=True
                    ):
                        total += count
                        bar.update(end - start)
        with atomic_file(target) as out:
            for part in part_paths:
                with open(part, "rb") as handle:
                    shutil.copyfileobj(handle, out, 1 << 22)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return total
