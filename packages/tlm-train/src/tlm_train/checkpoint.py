"""Training checkpoints: model, optimizer, iteration and any extra state, in one file that cannot half-exist.

The file is ``torch.save`` of plain containers and tensors only, so it loads with
``torch.load(weights_only=True)`` (no code runs at load). A SHA-256 digest over every tensor's
bytes and every other value is stored inside, so a bit flip that the zip container would not
notice is refused at load. Saving to a path writes a fresh, uniquely named temporary file in the
same folder (``O_EXCL``: a pre-existing file or symlink at that name is never followed), fsyncs
it, renames it over the target in one step and fsyncs the folder: a reader, or a process killed
at any moment, sees the old checkpoint or the new one, never a mix or a truncated file.
"""

import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import torch
from torch import Tensor, nn

from tlm_train._checks import check_int

FORMAT = "tlm-train-checkpoint/1"
_KEYS = {"format", "iteration", "model", "optimizer", "extra", "digest"}
# io.IOBase too: beartype reads BinaryIO/IO[bytes] as protocols that want .name and .mode, which io.BytesIO lacks.
Source = str | os.PathLike[str] | BinaryIO | IO[bytes] | io.IOBase


def _unwrap(model: nn.Module) -> nn.Module:
    # torch.compile wraps the real module; its state dict keys carry an "_orig_mod." prefix.
    return getattr(model, "_orig_mod", model)


def _digest(value: Any) -> str:
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
        h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
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


def save_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer, iteration: int, out: Source, **extra: Any
) -> None:
    """Write ``model``'s and ``optimizer``'s state, ``iteration`` and ``extra`` to ``out`` (a path or a binary file).

    ``extra`` is for what a bit-exact resume needs besides the two state dicts, for instance
    ``rng=rng_state()``, ``scheduler=scheduler.state_dict()``, ``sampler=sampler.state_dict()``;
    its values must be tensors, numbers, strings, None or containers of them.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_int("iteration", iteration, low=0)
    payload: dict[str, Any] = {
        "format": FORMAT,
        "iteration": iteration,
        "model": _unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "extra": dict(extra),
    }
    payload["digest"] = _digest(payload)
    if isinstance(out, (str, os.PathLike)):
        _save_atomically(payload, Path(os.fspath(out)))
    elif hasattr(out, "write"):
        torch.save(payload, cast(IO[bytes], out))
        if hasattr(out, "flush"):
            out.flush()
    else:
        raise TypeError(f"out must be a path or a binary file object, got {type(out).__name__}")


def _save_atomically(payload: dict[str, Any], path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"out must be a file path, got the directory {path}")
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot save {path}: the folder {folder} does not exist")
    # mkstemp opens with O_CREAT | O_EXCL (| O_NOFOLLOW): a fresh name each call, so concurrent
    # saves never share a temporary file, and an existing symlink there is never written through.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a checkpoint is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: Path) -> None:
    # The rename is durable only once the folder's entry is on disk.
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse fsync on folders
        pass
    finally:
        os.close(fd)


def _name(src: Source) -> str:
    if isinstance(src, (str, os.PathLike)):
        return os.fspath(src)
    return str(getattr(src, "name", f"<{type(src).__name__}>"))


def read_checkpoint(src: Source) -> dict[str, Any]:
    """The checked contents of a checkpoint: ``format``, ``iteration``, ``model``, ``optimizer``, ``extra``.

    Loads on the CPU with ``weights_only=True``; a truncated, corrupted or foreign file raises
    ``ValueError`` naming it.
    """
    name = _name(src)
    if not isinstance(src, (str, os.PathLike)) and not hasattr(src, "read"):
        raise TypeError(f"src must be a path or a binary file object, got {type(src).__name__}")
    try:
        payload = torch.load(cast("str | os.PathLike[str] | IO[bytes]", src), map_location="cpu", weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as error:
        raise ValueError(f"{name} is not a readable checkpoint (truncated or corrupt?): {error}") from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or set(payload) != _KEYS:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{name} is not a {FORMAT} file (found format {found!r})")
    stored = payload.pop("digest")
    if _digest(payload) != stored:
        raise ValueError(f"{name} is corrupt: its contents do not match the SHA-256 digest stored with them")
    return payload


def load_checkpoint(src: Source, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore ``model`` and ``optimizer`` from ``src`` and return the saved iteration.

    Everything is checked before anything is changed: a file whose parameters or optimizer groups
    do not fit ``model``/``optimizer`` raises ``ValueError`` and leaves both as they were. Extra
    state (RNG, scheduler, sampler) is in ``read_checkpoint(src)["extra"]``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    payload = read_checkpoint(src)
    name, model = _name(src), _unwrap(model)
    _check_fits(name, payload["model"], model.state_dict())
    saved_groups, groups = payload["optimizer"].get("param_groups", []), optimizer.param_groups
    saved_sizes, sizes = [len(g["params"]) for g in saved_groups], [len(g["params"]) for g in groups]
    if saved_sizes != sizes:
        raise ValueError(f"{name}: the optimizer has parameter groups of sizes {sizes}, the checkpoint {saved_sizes}")
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    return payload["iteration"]


def _check_fits(name: str, saved: dict[str, Tensor], current: dict[str, Tensor]) -> None:
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        raise ValueError(f"{name} does not fit the model: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    wrong = [
        f"{k}: model {tuple(current[k].shape)}, file {tuple(saved[k].shape)}"
        for k in current
        if current[k].shape != saved[k].shape
    ]
    if wrong:
        raise ValueError(f"{name} does not fit the model: shapes differ ({'; '.join(wrong[:5])})")
