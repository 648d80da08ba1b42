"""The training-state format (``train_state.pt``) and its verified reader; ``tlm_train`` writes it.

The file is ``torch.save`` of plain containers and tensors only (:func:`check_loadable`), so it loads with
``torch.load(weights_only=True)`` (no code runs at load). It carries a format tag and ends with a one-line
trailer holding the SHA-256 of every byte before it (torch's zip reader ignores it): a flipped bit anywhere in
the file, zip headers and padding included, is refused by :func:`load_train_state`. One hash per file: format 1
(tlm-train 0.3) also stored a SHA-256 over every tensor's bytes and every other value, which the trailer's made
redundant; such files are still read.
"""

import hashlib
import io
import os
from typing import IO, Any, BinaryIO, cast

import torch
from torch import Tensor

from tlm_core.atomic import read_input

FORMAT = "tlm-train-state/2"
#: The formats :func:`load_train_state` reads: this one, and format 1 (with its redundant ``digest`` field).
READABLE = (FORMAT, "tlm-train-state/1")
TRAILER = b"\n#tlm-train-state sha256 "
TRAILER_SIZE = len(TRAILER) + 64 + 1
# io.IOBase too: beartype reads BinaryIO/IO[bytes] as protocols that want .name and .mode, which io.BytesIO lacks.
Source = str | os.PathLike[str] | BinaryIO | IO[bytes] | io.IOBase


def check_loadable(value: Any, where: str = "checkpoint") -> None:
    """Refuse what ``torch.load(weights_only=True)`` could not load back: ``TypeError``/``ValueError`` naming where in
    ``value`` it is (tensors, numbers, strings, None, dtypes, devices, and dicts/lists/tuples of them pass)."""
    if isinstance(value, Tensor):
        if value.is_meta:
            raise ValueError(f"{where} is a tensor on the meta device (no data); materialise it before saving")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; checkpoint keys must be str or int")
            check_loadable(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_loadable(item, f"{where}[{i}]")
    elif not (value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device))):
        raise TypeError(
            f"{where} is a {type(value).__name__}, which torch.load(weights_only=True) cannot load; "
            f"store tensors, numbers, strings, None and dicts/lists/tuples of them"
        )


def source_name(src: Source) -> str:
    """How messages name ``src``: its path, or a file object's name."""
    if isinstance(src, (str, os.PathLike)):
        return os.fspath(src)
    return str(getattr(src, "name", f"<{type(src).__name__}>"))


def load_train_state(src: Source) -> dict[str, Any]:
    """The checked contents of a training-state file (without ``format``, nor format 1's ``digest``).

    Loads on the CPU with ``weights_only=True``; a truncated, corrupted or foreign file raises
    ``ValueError`` naming it."""
    name = source_name(src)
    if not isinstance(src, (str, os.PathLike)) and not hasattr(src, "read"):
        raise TypeError(f"src must be a path or a binary file object, got {type(src).__name__}")
    if isinstance(src, (str, os.PathLike)):
        data = read_input(src, "training state")  # a FIFO or device is refused, never waited on
    else:
        data = cast(IO[bytes], src).read()
    body, trailer = data[:-TRAILER_SIZE], data[-TRAILER_SIZE:]
    if not (trailer.startswith(TRAILER) and trailer.endswith(b"\n")):
        raise ValueError(f"{name} is not a {FORMAT} file (truncated, or written by something else: no SHA-256 trailer)")
    if hashlib.sha256(body).hexdigest().encode() != trailer[len(TRAILER) : -1]:
        raise ValueError(f"{name} is corrupt: its bytes do not match the SHA-256 recorded at its end")
    try:
        payload = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as error:  # torch raises several types for a bad file
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{name} is not a readable checkpoint (truncated or corrupt?): {first[:200]}") from None
    if not isinstance(payload, dict) or payload.get("format") not in READABLE:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{name} is not a {FORMAT} file (found format {found!r})")
    payload.pop("digest", None)  # format 1's SHA-256 of the contents: the trailer's has verified every byte
    payload.pop("format")
    return payload
