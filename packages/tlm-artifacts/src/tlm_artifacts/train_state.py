"""The training-state format (``train_state.pt``) and its verified reader; ``tlm_train`` writes it.

The file is ``torch.save`` of plain containers and tensors only, so it loads with
``torch.load(weights_only=True)`` (no code runs at load). It carries a format tag and a SHA-256 over every
tensor's bytes and every other value (:func:`digest`), and ends with a one-line trailer holding the SHA-256
of every byte before it (torch's zip reader ignores it): a flipped bit anywhere in the file, zip headers and
padding included, is refused by :func:`load_train_state`.
"""

import hashlib
import io
import os
from typing import IO, Any, BinaryIO, cast

import torch
from torch import Tensor

from tlm_core.atomic import read_input

FORMAT = "tlm-train-state/1"
TRAILER = b"\n#tlm-train-state sha256 "
TRAILER_SIZE = len(TRAILER) + 64 + 1
# io.IOBase too: beartype reads BinaryIO/IO[bytes] as protocols that want .name and .mode, which io.BytesIO lacks.
Source = str | os.PathLike[str] | BinaryIO | IO[bytes] | io.IOBase


def digest(value: Any) -> str:
    """The SHA-256 the format stores over ``value`` (every tensor's dtype, shape and bytes, every other value);
    ``TypeError``/``ValueError`` for anything ``torch.load(weights_only=True)`` could not load back."""
    h = hashlib.sha256()
    _feed(h, value, "checkpoint")
    return h.hexdigest()


def _feed(h: "hashlib._Hash", value: Any, where: str) -> None:
    """Hash ``value`` into ``h``; refuse anything that ``torch.load(weights_only=True)`` could not load."""
    if isinstance(value, Tensor):
        if value.is_meta:
            raise ValueError(f"{where} is a tensor on the meta device (no data); materialise it before saving")
        data = value.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        if data.numel():  # the tensor's own bytes, not a copy (hashlib reads large buffers without the GIL)
            h.update(cast(Any, data.view(torch.uint8).numpy()))
    elif isinstance(value, dict):
        h.update(f"D{len(value)}".encode())
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; checkpoint keys must be str or int")
            h.update(repr(key).encode())
            _feed(h, item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        h.update(f"{'L' if isinstance(value, list) else 'U'}{len(value)}".encode())
        for i, item in enumerate(value):
            _feed(h, item, f"{where}[{i}]")
    elif value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        h.update(f"{type(value).__name__}:{value!r}".encode())
    else:
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
    """The checked contents of a training-state file (without ``format`` and ``digest``).

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
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or "digest" not in payload:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{name} is not a {FORMAT} file (found format {found!r})")
    stored = payload.pop("digest")
    try:
        found_digest = digest(payload)
    except (TypeError, ValueError):
        found_digest = None
    if found_digest != stored:
        raise ValueError(f"{name} is corrupt: its contents do not match the SHA-256 digest stored with them")
    payload.pop("format")
    return payload
