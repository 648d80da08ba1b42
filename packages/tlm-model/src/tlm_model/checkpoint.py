"""Save a TransformerLM and load it back: one safetensors file that holds weights, config and a content hash.

Design (docs/reliability.md, "Checkpoints that cannot lose data"): a checkpoint is ONE file,
``model.safetensors``, so there is no pair to keep consistent. The safetensors library writes and
reads it (``tlm_model._weights``); its header metadata carries the config and a SHA-256 over
everything else that means something (the header's tensor table and metadata, then the tensor
bytes). ``tlm_core.atomic`` puts the file in place: a fresh temporary file beside the target, fsynced,
renamed over it in one step, the folder fsynced. A kill at any moment leaves the old file or the new
one under the real name, never a mix; two savers each write their own temporary file and the last
rename wins; a reader reads everything from the one file it opened, so a writer renaming a new file
in meanwhile cannot mix two versions.

The loader checks the header's tensor table against the config (every name and shape) before it
reads a tensor, then hashes the tensors it read and refuses a file whose hash differs.
"""

import dataclasses
import errno
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tlm_core.atomic import atomic_write, check_input, open_input
from tlm_core.checks import short_repr
from tlm_model import _weights
from tlm_model.config import ModelConfig
from tlm_model.inference import unwrap
from tlm_model.lm import COMPILED_PREFIX, TransformerLM

FORMAT_VERSION = 2
WEIGHTS_NAME = "model.safetensors"
_TLM_KEYS = frozenset({"tlm_format", "tlm_config", "tlm_sha256"})

#: Test seam: called with the name of each step of a save as it completes (tests kill the process
#: there). Steps: "temp-created" (the temporary file exists, empty), "written" (it holds the whole
#: file; tlm_core.atomic then fsyncs it and renames it in), "replaced" (renamed, the folder fsynced).
_after_step: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if _after_step is not None:
        _after_step(name)


# ---------------------------------------------------------------------------------------------
# Saving


def save_model_file(
    model: nn.Module, path: str | os.PathLike[str], *, state_dict: Mapping[str, torch.Tensor] | None = None
) -> Path:
    """Write ``model``'s weights and config to ``path`` all-or-nothing; return the path.

    ``path`` is a folder (created if needed; the file is ``<path>/model.safetensors``) or, when it
    ends in ``.safetensors``, the file itself. ``model`` is a TransformerLM, a ``torch.compile``d
    one or the result of :func:`compile_for_inference`; the file holds the plain course keys.
    ``state_dict``, when given, is written instead of ``model.state_dict()`` (a full state dict
    gathered from sharded ranks, say); it must fit ``model.config``.
    An existing checkpoint is replaced in one rename.
    """
    inner = unwrap(model)
    if not isinstance(inner, TransformerLM):
        raise TypeError(f"model must be a TransformerLM (or a compiled one), got {type(model).__name__}")
    path = Path(path)
    directory, target = (path.parent, path) if path.suffix == ".safetensors" else (path, path / WEIGHTS_NAME)
    state = inner.state_dict() if state_dict is None else dict(state_dict)
    if state_dict is not None:
        _check_fits(inner.config, {k: _weights.Entry.of(v) for k, v in state.items()}, Path("state_dict"),
                    "the model's config")  # fmt: skip
    tensors = _weights.cpu_tensors(state)
    config = json.dumps(inner.config.to_dict(), sort_keys=True)
    metadata = {"format": "pt", "tlm_format": str(FORMAT_VERSION), "tlm_config": config}
    # The hash covers the header's tensor table, offsets included, which the library lays out: a
    # first serialization says where each tensor goes; the metadata's new key moves no tensor.
    draft = _weights.serialize(tensors, metadata)
    header, start = _weights.header_of(draft)
    metadata["tlm_sha256"] = _digest(header, [memoryview(draft)[start:]])
    del draft
    blob = _weights.serialize(tensors, metadata)

    def write(handle: Any) -> None:
        _step("temp-created")
        handle.write(blob)
        _step("written")

    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(target, write)
    _step("replaced")
    return path


def _bytes(tensor: torch.Tensor) -> memoryview:
    # A view of the tensor's own memory (no copy), for hashing.
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _digest(header: Mapping[str, Any], chunks: Iterable[torch.Tensor | memoryview | bytes]) -> str:
    h = hashlib.sha256(_canonical(header))
    for chunk in chunks:
        h.update(_bytes(chunk) if isinstance(chunk, torch.Tensor) else chunk)
    return h.hexdigest()


def _canonical(header: Mapping[str, Any]) -> bytes:
    # The header minus the hash itself, in one fixed serialisation: a changed dtype, shape, offset,
    # name or config changes these bytes even when the file's JSON stays valid.
    meta = {k: v for k, v in header.get("__metadata__", {}).items() if k != "tlm_sha256"}
    return json.dumps({**header, "__metadata__": meta}, sort_keys=True, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------------------------
# Loading


def load_model_file(
    path: str | os.PathLike[str],
    *,
    config: ModelConfig | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **options: Any,
) -> TransformerLM:
    """Build the TransformerLM saved at ``path`` and load its weights.

    ``path`` is what :func:`save_model_file` wrote (a folder or a ``.safetensors`` file), or a plain
    state-dict file (``.safetensors`` without tlm metadata, or a ``torch.save`` file read with
    ``weights_only``), which needs ``config=``. ``config``, when given, must equal the saved one;
    otherwise ``ValueError`` names every field that differs. Every tensor name and shape is checked
    against the config before a tensor is read; a file whose content hash differs is refused; each
    error names the file. ``dtype`` defaults to the dtype the weights were saved in, so a model
    reloads bit for bit; ``device`` defaults to torch's default device.

    ``options`` (e.g. ``fused=``, ``attention_backend=``) go to ``TransformerLM``. They
    are not saved: they change how the model computes, not what it is.
    """
    if config is not None and not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig or None, got {type(config).__name__}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, "no such checkpoint (file or folder)", str(path))
    weights = _weights_path(path)
    if not weights.exists():  # something that is not a regular file is refused by name when it is opened
        raise FileNotFoundError(
            errno.ENOENT, f"not a tlm checkpoint: missing {WEIGHTS_NAME} (save_model_file writes it)", str(weights)
        )
    if weights.suffix != ".safetensors":
        saved, state = _load_torch_file(weights, config)
    else:
        saved, state = _load_safetensors(weights, config)
    if config is not None:
        _check_same(saved, config, weights)
    if dtype is None:
        dtype = _saved_dtype(state, weights)
    model = TransformerLM(saved, device=device, dtype=dtype, **options)
    model.load_state_dict(state, strict=True)
    return model


def _weights_path(path: Path) -> Path:
    return path / WEIGHTS_NAME if path.is_dir() else path


def _load_safetensors(path: Path, config: ModelConfig | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    with open_input(path, "model file") as handle, _weights.TensorFile(handle, path) as file:
        # Any one of the three keys marks a tlm file, so a damaged key name cannot pass for a plain one.
        embedded = bool(_TLM_KEYS & set(file.metadata))
        if embedded:
            saved, source = _embedded_config(file.metadata, path), f"the config stored in {path}"
        elif config is not None:
            saved, source = config, "config="
        else:
            raise _no_config(path)
        _check_fits(saved, file.table, path, source)
        state = file.tensors()
    if embedded:
        digest = _digest(file.header, state.values())  # state is in file order
        if digest != file.metadata.get("tlm_sha256"):
            raise ValueError(
                f"{path} is corrupt: its content hash is {digest}, the file says "
                f"{short_repr(file.metadata.get('tlm_sha256'))}; it changed after it was written (bit flip, partial "
                f"copy or edit)"
            )
    return saved, state


def _embedded_config(meta: Mapping[str, str], path: Path) -> ModelConfig:
    if missing := sorted(_TLM_KEYS - set(meta)):
        raise ValueError(f"{path} is corrupt: its metadata lacks {missing} (a tlm checkpoint has {sorted(_TLM_KEYS)})")
    version = meta["tlm_format"]
    if version != str(FORMAT_VERSION):
        raise ValueError(f"{path} has tlm_format {short_repr(version)}; this tlm-model reads format {FORMAT_VERSION}")
    data = _weights.parse_json_object(meta["tlm_config"], path)
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    if unknown := sorted(set(data) - set(fields)):
        raise ValueError(f"{path}: unknown ModelConfig fields {_weights.names(unknown)}; expected a subset of {fields}")
    try:
        return ModelConfig.from_dict(data)
    except (TypeError, ValueError) as err:
        raise _weights.one_line(err, str(path)) from None


def _load_torch_file(path: Path, config: ModelConfig | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if config is None:
        raise _no_config(path)
    check_input(path, "model file")  # a FIFO or device is refused here, before torch.load would wait on it
    try:
        # mmap: tensors stay on disk until load_state_dict copies them, so the check below runs first.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises RuntimeError, pickle errors, EOFError, ... for a bad file
        raise ValueError(f"{path} is not a readable torch.save file: {str(err).splitlines()[0]}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} must hold a state dict (names to tensors), got {type(state).__name__}")
    state = {k.removeprefix(COMPILED_PREFIX): v for k, v in state.items()}
    _check_fits(config, {k: _weights.Entry.of(v) for k, v in state.items()}, path, "config=")
    return config, state


def _no_config(path: Path) -> ValueError:
    return ValueError(f"{path} is a plain state dict that carries no config; pass config= (the CLI: --preset)")


def _check_fits(config: ModelConfig, table: Mapping[str, _weights.Entry], path: Path, source: str) -> None:
    # Names and shapes come from the config alone (nothing of its size is built), so the table is
    # checked before a byte of tensor data is read, however large the config claims to be.
    if problems := _weights.table_problems(_weights.expected_shapes(config), table, "the config"):
        raise ValueError(f"{path} does not match {source}: " + "; ".join(problems))


def _check_same(saved: ModelConfig, requested: ModelConfig, path: Path) -> None:
    differences = []
    for field in dataclasses.fields(ModelConfig):
        have, want = getattr(saved, field.name), getattr(requested, field.name)
        if have != want:
            differences.append(f"{field.name} is {have!r} in the checkpoint but {want!r} requested")
    if differences:
        raise ValueError(f"checkpoint config mismatch in {path}: " + "; ".join(differences))


def _saved_dtype(state: dict[str, torch.Tensor], path: Path) -> torch.dtype:
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) > 1:
        names = sorted(str(d) for d in dtypes)
        raise ValueError(f"{path} holds tensors of several dtypes {names}; pass dtype= to choose one")
    return dtypes.pop() if dtypes else torch.get_default_dtype()


def _metadata(path: Path) -> dict[str, str]:
    # From the header alone, which the library validates; no tensor is read.
    with open_input(path, "model file") as handle, _weights.TensorFile(handle, path) as file:
        return file.metadata


def read_digest(path: str | os.PathLike[str]) -> str:
    """The SHA-256 that the header of a tlm model file records (its header alone is read, not checked
    against the tensors: :func:`load_model_file` does that). ``path`` is the file or its folder."""
    weights = _weights_path(Path(path))
    digest = _metadata(weights).get("tlm_sha256")
    if digest is None:
        raise ValueError(f"{weights} is not a tlm model file: its header records no tlm_sha256")
    return digest


def read_model_file(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the state dict of a tlm model file (or its folder), checked like
    :func:`load_model_file` checks them (tensor table against the config, SHA-256), without building a model."""
    weights = _weights_path(Path(path))
    if not weights.is_file():
        raise FileNotFoundError(errno.ENOENT, f"not a tlm checkpoint: missing {WEIGHTS_NAME}", str(weights))
    return _load_safetensors(weights, None)


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The config a tlm model file (or its folder) records, from its header alone (fast; the tensors and
    their SHA-256 are :func:`load_model_file`'s to check)."""
    weights = _weights_path(Path(path))
    meta = _metadata(weights)
    if not _TLM_KEYS & set(meta):
        raise ValueError(f"{weights} is not a tlm model file: its header records no config")
    return _embedded_config(meta, weights)
