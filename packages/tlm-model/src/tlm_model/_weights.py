"""``.safetensors`` files through the safetensors library, with the checks tlm adds around it.

The library writes the format, validates it (dtypes, shapes, offsets that tile the data exactly, the
metadata's types) and reads the tensors. Before it sees a file, :class:`TensorFile` bounds the header
itself: its length must fit the file and the library's 100 MB limit, and its JSON may list no more
tensors than any model tlm builds, so a lying header fills no memory. The library then reads the very
file that was checked, through the name of the handle already open on it (a file renamed over it
meanwhile, or a folder swapped under an HF reader, is not read by mistake). What the file must hold
(names, shapes, floating dtypes) is checked against the config with :func:`check_table` before any
tensor is read. The model file (``checkpoint.py``) and HF folders (``interop.py``) share these helpers.
"""

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from tlm_core.checks import rephrased, short_repr
from tlm_model.config import ModelConfig
from tlm_model.lm import TransformerLM

# The library refuses headers above 100 MB; so do we, before reading one.
MAX_HEADER = 100_000_000
# More tensors than any model tlm can build (3 + 9 per layer x 1,024 layers = 9,219): a header that
# claims more is refused while it is parsed, before a lying table of millions of entries fills memory.
MAX_TENSORS = 1 << 16
# A config.json (or an HF index) larger than this is not one: the biggest real ones are well under 1 MB.
MAX_JSON_BYTES = 16 << 20
# How many names an error message lists before it says how many more there are.
LISTED = 4
# The safetensors dtypes a model's weights may have (float8 and the like are not trained or loaded here).
FLOATING = frozenset({"F64", "F32", "F16", "BF16"})


def names(items: list[str], limit: int = LISTED) -> str:
    """A list of names for an error message: the first ``limit``, each quoted short, then how many more."""
    shown = "[" + ", ".join(short_repr(name, 60) for name in items[:limit]) + "]"
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit:,} more"


def one_line(err: Exception, prefix: str, limit: int = 300) -> Exception:
    """``err``'s type with ``prefix: message``, the message cut to one short line."""
    text = " ".join(str(err).split())
    if len(text) > limit:
        text = f"{text[: limit - 20]}... ({len(text):,} chars)"
    return rephrased(err, f"{prefix}: {text}")


def parse_json_object(text: str | bytes, path: str | os.PathLike[str], object_pairs_hook: Any = None) -> dict[str, Any]:
    """``text`` (bytes: UTF-8) parsed as a JSON object; anything else is a one-line ValueError that starts
    with ``path`` (a file, or words that name the text). ``object_pairs_hook`` is json.loads'; what it
    raises passes through."""
    try:
        data: Any = json.loads(
            text.decode("utf-8") if isinstance(text, bytes) else text, object_pairs_hook=object_pairs_hook
        )
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON: it nests too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------------------------
# Writing


def cpu_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as the library saves it: detached, contiguous CPU tensors, each with its own memory."""
    out, seen = {}, set()
    for name, tensor in state.items():
        if tensor.is_meta:
            raise ValueError(
                f"cannot save {name}: it is on the meta device (no data); materialise the model first "
                f"with to_empty() and reset_parameters() or load_state_dict()"
            )
        tensor = tensor.detach().to("cpu").contiguous()
        # One tensor under two names (a head tied by hand) is written twice; the library refuses shared memory.
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        out[name] = tensor
    return out


def serialize(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (from :func:`cpu_tensors`) and ``metadata``."""
    return save(dict(tensors), metadata=dict(metadata))


def header_of(data: bytes) -> tuple[dict[str, Any], int]:
    """The header of the safetensors bytes ``data`` (made by :func:`serialize`) and where its tensor data starts."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), 8 + n


# ---------------------------------------------------------------------------------------------
# Reading


class _TooMany(Exception):
    pass


def _read_header(handle: BinaryIO, path: Path) -> dict[str, Any]:
    size = os.fstat(handle.fileno()).st_size
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise ValueError(f"{path} is truncated: it is {size} bytes long, shorter than safetensors' 8-byte prefix")
    n = int.from_bytes(prefix, "little")
    if n > min(MAX_HEADER, size - 8):
        raise ValueError(
            f"{path} is truncated or not a safetensors file: its header claims {n} bytes, the file holds {size - 8}"
        )
    objects = 0

    def count(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # Called once per JSON object as it is parsed: each tensor entry is one, plus the metadata
        # and the header itself.
        nonlocal objects
        objects += 1
        if objects > MAX_TENSORS + 2:
            raise _TooMany
        return dict(pairs)

    try:
        return parse_json_object(handle.read(n), f"{path} is corrupt: its safetensors header", count)
    except _TooMany:
        raise ValueError(
            f"{path} is not a model tlm can read: its header lists more than {MAX_TENSORS:,} tensors"
        ) from None


def _name_of(handle: BinaryIO, path: Path) -> str:
    # The library opens files by name. The name of the open handle makes it read the file checked
    # here, even one renamed over or deleted since; a platform without such names reads ``path``.
    for folder in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(folder):
            return f"{folder}/{handle.fileno()}"
    return str(path)  # pragma: no cover - POSIX systems have one of the two


class Entry(NamedTuple):
    """A tensor as a file's header describes it (``dtype`` as safetensors spells it, e.g. ``"F32"``)."""

    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Entry":
        """The entry of a tensor already in memory (a state dict read by ``torch.load``)."""
        return cls(_NAMES.get(tensor.dtype, str(tensor.dtype)), tuple(tensor.shape))


_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


class TensorFile:
    """The safetensors file open in ``handle`` (named ``path`` in messages), read by the library.

    ``header`` is the parsed header, ``metadata`` its string map, ``table`` each tensor's
    :class:`Entry`; nothing of the tensors' size is allocated before :meth:`tensors`. Every problem is
    a one-line ``ValueError`` naming ``path``.
    """

    def __init__(self, handle: BinaryIO, path: Path) -> None:
        self.path = path
        self.header = _read_header(handle, path)
        try:
            self._file = safe_open(_name_of(handle, path), framework="pt")
            self._file.__enter__()
            self.metadata: dict[str, str] = self._file.metadata() or {}
            # File order, which the library validated along with the rest of the header.
            self.order = sorted(self._file.keys(), key=lambda name: self.header[name]["data_offsets"][0])
            self.table = {}
            for name in self.order:
                info = self._file.get_slice(name)
                self.table[name] = Entry(info.get_dtype(), tuple(info.get_shape()))
        except SafetensorError as err:
            raise self._refusal(err) from None

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self._file.__exit__(kind, err, tb)

    def _refusal(self, err: Exception) -> ValueError:
        return ValueError(str(one_line(err, f"{self.path} is corrupt or truncated: not a valid safetensors file", 150)))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, in file order."""
        try:
            return {name: self._file.get_tensor(name) for name in self.order}
        except SafetensorError as err:  # pragma: no cover - the header was validated above
            raise self._refusal(err) from None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
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


def table_problems(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, Entry | None],
    needs: str,
    *,
    unexpected: str = "unexpected tensors",
) -> list[str]:
    """What keeps a tensor table (name -> :class:`Entry`, or None where only the name is known) from
    being ``expected`` (name -> shape): missing and unexpected names, other shapes, dtypes that are not
    floating; every list cut short, so that a table of thousands of names makes a one-line message."""
    problems = []
    if missing := sorted(set(expected) - set(found)):
        problems.append(f"missing tensors {names(missing)}")
    if extra := sorted(set(found) - set(expected)):
        problems.append(f"{unexpected} {names(extra)}")
    wrong = []
    for name in sorted(set(expected) & set(found)):
        if (entry := found[name]) is None:
            continue
        if entry.shape != expected[name]:
            wrong.append(f"{name} has shape {short_repr(list(entry.shape))}, {needs} needs {list(expected[name])}")
        elif entry.dtype not in FLOATING:
            wrong.append(f"{name} is {entry.dtype}, not a floating dtype ({', '.join(sorted(FLOATING))})")
    problems += wrong[:LISTED]
    if len(wrong) > LISTED:
        problems.append(f"and {len(wrong) - LISTED:,} more tensors of another shape or dtype")
    return problems
