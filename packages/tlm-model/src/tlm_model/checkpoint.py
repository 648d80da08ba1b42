"""Save a TransformerLM and load it back: one safetensors file that holds weights, config and a content hash.

Design (docs/reliability.md, "Checkpoints that cannot lose data"): a checkpoint is ONE file,
``model.safetensors``, so there is no pair to keep consistent. Its safetensors header carries the
config and a SHA-256 over everything else that means something (the header's tensor table and
config, then the tensor bytes). A save writes a fresh, uniquely named temporary file beside the
target (created with ``O_EXCL | O_NOFOLLOW``, so no symlink is ever followed), fsyncs it, renames it
over the target in one ``os.replace`` and fsyncs the folder. A kill at any moment leaves the old
file or the new one under the real name, never a mix; two savers each write their own temporary
file and the last rename wins; a reader opens the file once and reads everything from that one
open file, so a writer renaming a new file in meanwhile cannot mix two versions.

The loader reads the header alone first and checks the config against it (every tensor name and
shape) before it allocates anything, then reads the tensors while hashing them and refuses a file
whose hash differs. The 0.1.0 layout (``config.json`` + a plain ``model.safetensors``) still loads,
without the hash check it never had.
"""

import dataclasses
import errno
import hashlib
import io
import json
import os
import secrets
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tlm_core.checks import short_repr
from tlm_model.config import ModelConfig
from tlm_model.lm import COMPILED_PREFIX, TransformerLM, unwrap

FORMAT_VERSION = 2
LEGACY_FORMAT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
_TMP_PREFIX = "." + WEIGHTS_NAME + "."
_TMP_SUFFIX = ".tmp"
# safetensors refuses headers above 100 MB; so do we, before reading one.
_MAX_HEADER = 100_000_000
# More tensors than any model tlm can build (3 + 9 per layer x 1,024 layers = 9,219): a header that
# claims more is refused while it is parsed, before a lying table of millions of entries fills memory.
_MAX_TENSORS = 1 << 16
# A config.json (or an HF index) larger than this is not one: the biggest real ones are well under 1 MB.
_MAX_JSON_BYTES = 16 << 20
# How many names an error message lists before it says how many more there are.
_LISTED = 4
_TLM_KEYS = frozenset({"tlm_format", "tlm_config", "tlm_sha256"})
_CHUNK = 1 << 24
# Never follow a symlink where the temporary file goes (O_NOFOLLOW is POSIX; O_EXCL alone already
# refuses an existing name, links included); close the file in a forked child.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}

#: Test seam: called with the name of each step of a save as it completes (tests kill the process
#: there). Steps: "temp-created", "header-written", "tensor-written" (after each tensor), "fsynced",
#: "renamed", "folder-fsynced", "legacy-config-removed".
_after_step: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if _after_step is not None:
        _after_step(name)


# ---------------------------------------------------------------------------------------------
# Saving


def save_checkpoint(
    model: nn.Module, path: str | os.PathLike[str], *, state_dict: Mapping[str, torch.Tensor] | None = None
) -> Path:
    """Write ``model``'s weights and config to ``path`` all-or-nothing; return the path.

    ``path`` is a folder (created if needed; the file is ``<path>/model.safetensors``) or, when it
    ends in ``.safetensors``, the file itself. ``model`` is a TransformerLM, a ``torch.compile``d
    one or the result of :func:`compile_for_inference`; the file holds the plain course keys.
    ``state_dict``, when given, is written instead of ``model.state_dict()`` (a full state dict
    gathered from sharded ranks, say); it must fit ``model.config``.
    An existing checkpoint is replaced in one rename; a ``config.json`` of the 0.1.0 layout beside
    it is removed afterwards (the new file carries its own config).
    """
    inner = unwrap(model)
    if not isinstance(inner, TransformerLM):
        raise TypeError(f"model must be a TransformerLM (or a compiled one), got {type(model).__name__}")
    path = Path(path)
    directory, target = (path.parent, path) if path.suffix == ".safetensors" else (path, path / WEIGHTS_NAME)
    state = inner.state_dict() if state_dict is None else dict(state_dict)
    if state_dict is not None:
        entries = {k: _Entry(v.dtype, tuple(v.shape), 0, 0) for k, v in state.items()}
        _check_fits(inner.config, entries, Path("state_dict"), "the model's config")
    tensors = _cpu_tensors(state)
    config = json.dumps(inner.config.to_dict(), sort_keys=True)
    header = _header(tensors, {"format": "pt", "tlm_format": str(FORMAT_VERSION), "tlm_config": config})
    digest = _digest(header, (tensors[name] for name in _order(tensors)))
    header["__metadata__"]["tlm_sha256"] = digest
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # pad the header to 8 bytes, as safetensors' own writer does

    directory.mkdir(parents=True, exist_ok=True)
    tmp = _create_temp(directory)
    try:
        _step("temp-created")
        with os.fdopen(os.open(tmp, os.O_WRONLY | _NOFOLLOW), "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            _step("header-written")
            for name in _order(tensors):
                f.write(_bytes(tensors[name]))
                _step("tensor-written")
            f.flush()
            os.fsync(f.fileno())
        _step("fsynced")
        os.replace(tmp, target)  # rename(2) replaces the entry itself: a symlink there is not followed
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _step("renamed")
    _fsync_folder(directory)
    _step("folder-fsynced")
    if target.name == WEIGHTS_NAME:
        _remove_legacy_config(directory / CONFIG_NAME)
        _step("legacy-config-removed")
    return path


def _cpu_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if tensor.is_meta:
            raise ValueError(
                f"cannot save {name}: it is on the meta device (no data); materialise the model first "
                f"with to_empty() and reset_parameters() or load_state_dict()"
            )
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"cannot save {name}: dtype {tensor.dtype} is not one of {sorted(map(str, _DTYPES))}")
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def _order(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    # Widest dtypes first, then by name: every tensor starts at a multiple of its item size.
    return sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))


def _header(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in _order(tensors):
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    return header


def _bytes(tensor: torch.Tensor) -> memoryview:
    # A view of the tensor's own memory (no copy), for hashing, writing and reading into.
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


def _create_temp(directory: Path) -> Path:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
    while True:
        # pid + random: unique across processes and threads; O_EXCL refuses anything already there.
        tmp = directory / f"{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}{_TMP_SUFFIX}"
        try:
            os.close(os.open(tmp, flags, 0o666))
            return tmp
        except FileExistsError:
            continue


def _fsync_folder(directory: Path) -> None:
    if os.name != "posix":  # folders cannot be opened for fsync elsewhere; the rename is still atomic
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_legacy_config(path: Path) -> None:
    # Only a config.json that 0.1.0's save_checkpoint wrote: left beside the new file, tlm 0.1.0
    # would pair it with weights it does not describe.
    try:
        if path.is_symlink() or not path.is_file():
            return
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(data, dict) and data.get("format") == LEGACY_FORMAT_VERSION:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Loading


@dataclasses.dataclass
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_header(f: io.BufferedReader, path: Path) -> tuple[dict[str, Any], dict[str, _Entry], int]:
    """Parse and check a safetensors header; returns (raw header, entries, data length)."""
    size = os.fstat(f.fileno()).st_size
    prefix = f.read(8)
    if len(prefix) < 8:
        raise ValueError(f"{path} is truncated: it is {size} bytes long, shorter than safetensors' 8-byte prefix")
    (n,) = struct.unpack("<Q", prefix)
    if n > min(_MAX_HEADER, size - 8):
        raise ValueError(
            f"{path} is truncated or not a safetensors file: its header claims {n} bytes, the file holds {size - 8}"
        )
    header = _parse_header(f.read(n), path)
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{path} is corrupt: __metadata__ must map strings to strings")
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _BY_NAME[info["dtype"]]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in (*shape, begin, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{path} is corrupt: header entry {short_repr(name, 60)} is not a valid tensor: {short_repr(info)}"
            ) from None
        numel = 0 if 0 in shape else 1
        for d in shape if numel else ():
            numel *= d
            if numel > size:  # more elements than the file has bytes: refused below, before a giant product
                break
        if end - begin != numel * dtype.itemsize:
            raise ValueError(
                f"{path} is corrupt: tensor {short_repr(name, 60)} of shape {short_repr(list(shape))} and dtype "
                f"{info['dtype']} needs {_at_least(numel * dtype.itemsize, size)} bytes, its offsets span {end - begin}"
            )
        entries[name] = _Entry(dtype, shape, begin, end)
    data = size - 8 - n
    expected = 0
    for name in sorted(entries, key=lambda k: (entries[k].begin, entries[k].end)):
        if entries[name].begin != expected:
            raise ValueError(
                f"{path} is corrupt: tensor {short_repr(name, 60)} starts at byte {entries[name].begin}, not {expected}"
            )
        expected = entries[name].end
    if expected != data:
        what = "truncated" if expected > data else "corrupt"
        raise ValueError(f"{path} is {what}: its header describes {expected} bytes of tensor data, the file has {data}")
    return header, entries, data


def _at_least(count: int, size: int) -> str:
    return str(count) if count <= size else f"more than {size}"


class _TooMany(Exception):
    pass


def _parse_header(raw: bytes, path: Path) -> dict[str, Any]:
    objects = 0

    def count(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # Called once per JSON object as it is parsed: each tensor entry is one, plus the metadata
        # and the header itself.
        nonlocal objects
        objects += 1
        if objects > _MAX_TENSORS + 2:
            raise _TooMany
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=count)
    except _TooMany:
        raise ValueError(
            f"{path} is not a model tlm can read: its header lists more than {_MAX_TENSORS:,} tensors"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is corrupt: its safetensors header is not valid JSON ({err})") from None
    except RecursionError:
        raise ValueError(f"{path} is corrupt: its safetensors header nests too deeply to be a tensor table") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is corrupt: its safetensors header is a {type(header).__name__}, not an object")
    return header


def _read_tensors(f: io.BufferedReader, entries: Mapping[str, _Entry]) -> dict[str, torch.Tensor]:
    """Read every tensor of ``entries`` from ``f`` (positioned at the data) in file order."""
    out = {}
    for name in sorted(entries, key=lambda k: entries[k].begin):
        entry = entries[name]
        tensor = torch.empty(entry.shape, dtype=entry.dtype)
        view = _bytes(tensor)
        done = 0
        while done < len(view):
            got = f.readinto(view[done : done + _CHUNK])
            if not got:
                raise EOFError  # the file shrank under us: the size checked above no longer holds
            done += got
        out[name] = tensor
    return out


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    config: ModelConfig | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **options: Any,
) -> TransformerLM:
    """Build the TransformerLM saved at ``path`` and load its weights.

    ``path`` is what :func:`save_checkpoint` wrote (a folder or a ``.safetensors`` file), a folder
    of the 0.1.0 layout (``config.json`` + ``model.safetensors``), or a plain state-dict file
    (``.safetensors`` without tlm metadata, or a ``torch.save`` file read with ``weights_only``),
    which needs ``config=``. ``config``, when given, must equal the saved one; otherwise
    ``ValueError`` names every field that differs. Every tensor name and shape is checked against the
    config before anything is allocated; a file whose content hash differs is refused; each error
    names the file. ``dtype`` defaults to the dtype the weights were saved in, so a model reloads
    bit for bit; ``device`` defaults to torch's default device.

    ``options`` (e.g. ``fused=``, ``attention_backend=``) go to ``TransformerLM``. They
    are not saved: they change how the model computes, not what it is.
    """
    if config is not None and not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig or None, got {type(config).__name__}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, "no such checkpoint (file or folder)", str(path))
    weights = path / WEIGHTS_NAME if path.is_dir() else path
    if not weights.is_file():
        raise FileNotFoundError(
            errno.ENOENT, f"not a tlm checkpoint: missing {WEIGHTS_NAME} (save_checkpoint writes it)", str(weights)
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


def _load_safetensors(path: Path, config: ModelConfig | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    with open(path, "rb") as f:
        header, entries, _ = _read_header(f, path)
        meta = header.get("__metadata__", {})
        # Any one of the three keys marks a tlm file, so a damaged key name cannot pass for 0.1.0.
        embedded = bool(_TLM_KEYS & set(meta))
        if embedded:
            saved = _embedded_config(meta, path)
            source = f"the config stored in {path}"
        else:
            saved, source = _legacy_config(path, config)
        _check_fits(saved, entries, path, source)
        try:
            state = _read_tensors(f, entries)
        except EOFError:
            raise ValueError(f"{path} is truncated: it shrank while being read") from None
    if embedded:
        digest = _digest(header, (state[k] for k in sorted(state, key=lambda k: entries[k].begin)))
        if digest != meta.get("tlm_sha256"):
            raise ValueError(
                f"{path} is corrupt: its content hash is {digest}, the file says {short_repr(meta.get('tlm_sha256'))}; "
                f"it changed after it was written (bit flip, partial copy or edit)"
            )
    return saved, state


def _embedded_config(meta: Mapping[str, str], path: Path) -> ModelConfig:
    if missing := sorted(_TLM_KEYS - set(meta)):
        raise ValueError(f"{path} is corrupt: its metadata lacks {missing} (a tlm checkpoint has {sorted(_TLM_KEYS)})")
    version = meta["tlm_format"]
    if version != str(FORMAT_VERSION):
        raise ValueError(f"{path} has tlm_format {short_repr(version)}; this tlm-model reads format {FORMAT_VERSION}")
    return _parse_config(meta["tlm_config"], path, with_format=False)


def _legacy_config(weights: Path, config: ModelConfig | None) -> tuple[ModelConfig, str]:
    config_path = weights.parent / CONFIG_NAME
    if weights.name == WEIGHTS_NAME and config_path.is_file():
        return _parse_config(_read_small(config_path), config_path, with_format=True), str(config_path)
    if config is not None:
        return config, "config="
    raise FileNotFoundError(
        errno.ENOENT,
        f"not a tlm checkpoint: {weights.name} carries no config and {CONFIG_NAME} is missing; pass config=",
        str(config_path),
    )


def _read_small(path: Path, limit: int = _MAX_JSON_BYTES) -> bytes:
    """The bytes of a JSON file that must be small (a config, an index); a larger one is refused unread."""
    with open(path, "rb") as f:
        return _read_small_file(f, path, limit)


def _read_small_file(f: io.BufferedReader, path: Path, limit: int = _MAX_JSON_BYTES) -> bytes:
    data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is over {limit:,} bytes: too large for a config or index file")
    return data


def _parse_json_object(text: str | bytes, path: str | os.PathLike[str]) -> dict[str, Any]:
    """``text`` parsed as a JSON object; anything else is a one-line ValueError naming ``path``."""
    try:
        data: Any = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON: it nests too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _one_line(err: Exception, prefix: str, limit: int = 300) -> Exception:
    """``err``'s type with ``prefix: message``, the message cut to one short line."""
    text = " ".join(str(err).split())
    if len(text) > limit:
        text = f"{text[: limit - 20]}... ({len(text):,} chars)"
    return type(err)(f"{prefix}: {text}")


def _parse_config(text: str | bytes, path: Path, *, with_format: bool) -> ModelConfig:
    data = _parse_json_object(text, path)
    if with_format:
        if "format" not in data:
            raise ValueError(f'{path} has no "format" field, so save_checkpoint did not write it')
        version = data.pop("format")
        if isinstance(version, bool) or version != LEGACY_FORMAT_VERSION:
            raise ValueError(
                f'{path} has "format": {short_repr(version)}; a config.json beside the weights is checkpoint format '
                f"{LEGACY_FORMAT_VERSION} (tlm-model 0.1.0)"
            )
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    if unknown := sorted(set(data) - set(fields)):
        raise ValueError(f"{path}: unknown ModelConfig fields {_names(unknown)}; expected a subset of {fields}")
    try:
        return ModelConfig.from_dict(data)
    except (TypeError, ValueError) as err:
        raise _one_line(err, str(path)) from None


def _names(items: list[str], limit: int = _LISTED) -> str:
    """A list of names for an error message: the first ``limit``, each quoted short, then how many more."""
    shown = "[" + ", ".join(short_repr(name, 60) for name in items[:limit]) + "]"
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit:,} more"


def _load_torch_file(path: Path, config: ModelConfig | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if config is None:
        raise ValueError(f"{path} is a plain state dict that carries no config; pass config= (the CLI: --preset)")
    try:
        # mmap: tensors stay on disk until load_state_dict copies them, so the check below runs first.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises RuntimeError, pickle errors, EOFError, ... for a bad file
        raise ValueError(f"{path} is not a readable torch.save file: {str(err).splitlines()[0]}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} must hold a state dict (names to tensors), got {type(state).__name__}")
    state = {k.removeprefix(COMPILED_PREFIX): v for k, v in state.items()}
    entries = {k: _Entry(v.dtype, tuple(v.shape), 0, 0) for k, v in state.items()}
    _check_fits(config, entries, path, "config=")
    return config, state


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict name of a model of ``config`` and its shape, read off a one-layer model on the
    meta device: the layers are alike, so a 1,024-layer config costs one layer's modules, not 1,024."""
    one = TransformerLM(dataclasses.replace(config, num_layers=1), device="meta")
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in one.state_dict().items():
        if name.startswith("layers.0."):
            rest = name.removeprefix("layers.0.")
            shapes.update((f"layers.{i}.{rest}", tuple(tensor.shape)) for i in range(config.num_layers))
        else:
            shapes[name] = tuple(tensor.shape)
    return shapes


def _table_problems(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[torch.dtype, tuple[int, ...]] | None],
    needs: str,
    *,
    unexpected: str = "unexpected tensors",
) -> list[str]:
    """What keeps a tensor table (name -> (dtype, shape), or None where only the name is known) from
    being ``expected`` (name -> shape): missing and unexpected names, other shapes, dtypes that are not
    floating; every list cut short, so that a table of thousands of names makes a one-line message."""
    problems = []
    if missing := sorted(set(expected) - set(found)):
        problems.append(f"missing tensors {_names(missing)}")
    if extra := sorted(set(found) - set(expected)):
        problems.append(f"{unexpected} {_names(extra)}")
    wrong = []
    for name in sorted(set(expected) & set(found)):
        if (table := found[name]) is None:
            continue
        dtype, shape = table
        if shape != expected[name]:
            wrong.append(f"{name} has shape {short_repr(list(shape))}, {needs} needs {list(expected[name])}")
        elif not dtype.is_floating_point:
            wrong.append(f"{name} is {dtype}, not a floating dtype")
    problems += wrong[:_LISTED]
    if len(wrong) > _LISTED:
        problems.append(f"and {len(wrong) - _LISTED:,} more tensors of another shape or dtype")
    return problems


def _check_fits(config: ModelConfig, entries: Mapping[str, _Entry], path: Path, source: str) -> None:
    # Names and shapes come from the config alone (nothing of its size is built), so the table is
    # checked before a byte of tensor data is allocated, however large the config claims to be.
    found = {name: (entry.dtype, entry.shape) for name, entry in entries.items()}
    if problems := _table_problems(_expected_shapes(config), found, "the config"):
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


def read_digest(path: str | os.PathLike[str]) -> str:
    """The SHA-256 that the header of a tlm model file records (its header alone is read, not checked
    against the tensors: :func:`load_checkpoint` does that). ``path`` is the file or its folder."""
    path = Path(path)
    weights = path / WEIGHTS_NAME if path.is_dir() else path
    with open(weights, "rb") as f:
        header, _, _ = _read_header(f, weights)
    digest = header.get("__metadata__", {}).get("tlm_sha256")
    if not isinstance(digest, str):
        raise ValueError(f"{weights} is not a tlm model file: its header records no tlm_sha256")
    return digest


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the state dict of a tlm model file (or its folder), checked like
    :func:`load_checkpoint` checks them (tensor table against the config, SHA-256), without building a model."""
    path = Path(path)
    weights = path / WEIGHTS_NAME if path.is_dir() else path
    if not weights.is_file():
        raise FileNotFoundError(errno.ENOENT, f"not a tlm checkpoint: missing {WEIGHTS_NAME}", str(weights))
    with open(weights, "rb") as f:
        header, _, _ = _read_header(f, weights)
    if not _TLM_KEYS & set(header.get("__metadata__", {})):
        raise ValueError(f"{weights} is not a tlm model file (no tlm metadata); read it with load_checkpoint(config=)")
    return _load_safetensors(weights, None)


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The config a tlm model file (or its folder) records, from its header alone (fast; the tensors and
    their SHA-256 are :func:`load_checkpoint`'s to check)."""
    path = Path(path)
    weights = path / WEIGHTS_NAME if path.is_dir() else path
    with open(weights, "rb") as f:
        header, _, _ = _read_header(f, weights)
    meta = header.get("__metadata__", {})
    if not _TLM_KEYS & set(meta):
        raise ValueError(f"{weights} is not a tlm model file: its header records no config")
    return _embedded_config(meta, weights)
