"""Step folders, read: which steps a checkpoints folder holds, and the model of one step (either layout).

A step folder (``RUN/checkpoints/step_00000100/``) holds the model in tlm-model's own file
(``model.safetensors``: weights, ``ModelConfig`` and their SHA-256) and ``train_state.pt``, which records the
model file's SHA-256. A DDP/FSDP2 run's step folder instead holds ``shards/``, written by
torch.distributed.checkpoint (DCP) with each rank writing its own part, and ``train_state.pt`` records the
SHA-256 of each of those files; a LoRA run's holds ``adapter.safetensors`` (:mod:`tlm_artifacts.lora`).
``tlm_train.CheckpointManager`` writes them (all-or-nothing) and extends :class:`StepFolders`.

Only tensors go through DCP (``model.<name>``, ``optimizer.<name>.<key>``). DCP's own ``.metadata`` is a
pickle, so it is read only after its SHA-256 matched the one ``train_state.pt`` records, and then by an
unpickler that builds nothing but DCP's metadata classes.
"""

import contextlib
import errno
import hashlib
import os
import pathlib
import pickle
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tlm_artifacts.layout import (
    ADAPTER_NAME,
    LATEST_NAME,
    SHARDS_DIR,
    SHARDS_METADATA,
    STATE_NAME,
    STEP_PATTERN,
    step_name,
)
from tlm_artifacts.train_state import load_train_state
from tlm_core.atomic import open_input, read_input
from tlm_model import ModelConfig, TransformerLM, load_model_file
from tlm_model.checkpoint import WEIGHTS_NAME, read_config, read_model_file


class StepFolders:
    """The step folders in ``directory`` (``step_00000100/``, ...) and ``latest``, naming the newest one saved."""

    PATTERN = STEP_PATTERN

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def path(self, step: int) -> Path:
        return self.directory / step_name(step)

    def steps(self) -> list[int]:
        """Steps whose folder is complete (every file present), oldest first; never empty while a complete
        step exists, even as another process saves and prunes. Verification is the reader's.

        A folder listing is no snapshot: an entry renamed in or out while it is read may be missed, so a
        listing taken while a save puts step N+1 in place and a prune takes step N away can hold neither.
        The ``latest`` file, replaced atomically after each save and naming a step that no prune removes,
        fills that gap: it is read after the listing, and its step joins it."""
        found = set(self._listed())
        newest = self._pointed()
        if newest is not None:
            found.add(newest)
        return sorted(found)

    def _listed(self) -> list[int]:
        try:
            entries = list(os.scandir(self.directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        for entry in entries:
            match = self.PATTERN.fullmatch(entry.name)
            if match and entry.is_dir(follow_symlinks=False) and self._complete(entry.path):
                found.append(int(match.group(1)))
        return found

    @staticmethod
    def _complete(folder: str | os.PathLike[str]) -> bool:
        return is_complete(folder)

    def _pointer(self) -> int | None:
        try:
            pointer = read_input(self.directory / LATEST_NAME, "checkpoint pointer", limit=256).decode("utf-8")
            match = self.PATTERN.fullmatch(pointer.strip())
        except (OSError, ValueError):  # missing, not a regular file (a FIFO), too long or not UTF-8: no pointer
            return None
        return int(match.group(1)) if match else None

    def _pointed(self) -> int | None:
        """The step ``latest`` names while its folder is complete; None without one, or when its folder
        was removed by other means than a save (a stale pointer: the listing alone then counts)."""
        named = self._pointer()
        for _ in range(1000):
            if named is None:
                return None
            folder = self.path(named)
            if not folder.is_symlink() and self._complete(folder):
                return named
            again = self._pointer()
            if again == named:
                return None  # unchanged, so no save moved it on: its folder was taken away by hand
            named = again  # a save replaced it while we looked: look at the new one
        raise OSError(errno.EBUSY, "the checkpoints kept changing while they were listed", str(self.directory))

    def all_steps(self) -> list[int]:
        """Every step folder, complete or not (a damaged copy, a folder missing a file)."""
        try:
            names = os.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(m.group(1)) for m in map(self.PATTERN.fullmatch, names) if m)


def is_complete(folder: str | os.PathLike[str]) -> bool:
    """Whether a step folder has every file: ``train_state.pt`` and the model file, the adapter file (LoRA) or
    DCP's metadata (sharded: DCP writes it last)."""
    return os.path.isfile(os.path.join(folder, STATE_NAME)) and (
        os.path.isfile(os.path.join(folder, WEIGHTS_NAME))
        or os.path.isfile(os.path.join(folder, ADAPTER_NAME))
        or os.path.isfile(os.path.join(folder, SHARDS_DIR, SHARDS_METADATA))
    )


def step_of(folder: Path) -> int | None:
    """The step a step folder's name gives, or None for another name."""
    match = STEP_PATTERN.fullmatch(folder.name)
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------------------------------------
# DCP shards, verified


@contextlib.contextmanager
def one_process_is_meant() -> Iterator[None]:
    """DCP warns on every call without a process group; reading a sharded step in one process is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def file_digests(folder: Path) -> dict[str, str]:
    """The SHA-256 of every file under ``folder``, keyed by its path relative to it (``/``-separated)."""
    digests = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            h = hashlib.sha256()
            with open_input(path, "checkpoint file") as handle:  # a FIFO or device is refused, never waited on
                while chunk := handle.read(1 << 20):
                    h.update(chunk)
            digests[path.relative_to(folder).as_posix()] = h.hexdigest()
    return digests


def verify_shards(folder: Path, recorded: dict[str, str]) -> None:
    """Refuse a DCP folder whose files are not exactly the ones ``train_state.pt`` recorded, byte for byte."""
    found = file_digests(folder) if folder.is_dir() else {}
    if missing := sorted(set(recorded) - set(found)):
        raise ValueError(f"{folder} lacks the shard files {missing[:5]} that {STATE_NAME} records")
    if extra := sorted(set(found) - set(recorded)):
        raise ValueError(f"{folder} holds files {extra[:5]} that {STATE_NAME} does not record")
    if changed := sorted(name for name in recorded if found[name] != recorded[name]):
        raise ValueError(f"{folder}: the shard files {changed[:5]} do not match the SHA-256 recorded in {STATE_NAME}")


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and the torch values in it (sizes, dtypes, layouts), nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        import torch.distributed.checkpoint.filesystem as dcp_fs
        import torch.distributed.checkpoint.metadata as dcp_meta

        allowed: Any = None
        if module == dcp_meta.__name__ or (module == dcp_fs.__name__ and name == "_StorageInfo"):
            allowed = getattr(sys.modules[module], name, None)
            allowed = allowed if isinstance(allowed, type) else None
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            allowed = getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):
            allowed = torch.serialization._get_layout
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            allowed = getattr(pathlib, name)
        if allowed is None:
            raise pickle.UnpicklingError(f"DCP metadata may not build {module}.{name}")
        return allowed


def shard_reader(folder: str | os.PathLike[str]) -> Any:
    """A DCP ``FileSystemReader`` of ``folder`` whose metadata is read by the restricted unpickler, tensors only."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

            with open_input(Path(self.path) / SHARDS_METADATA, "DCP metadata") as handle:
                try:
                    metadata = _MetadataUnpickler(handle).load()
                except Exception as error:  # a foreign or damaged pickle: several types
                    raise ValueError(f"{self.path}: not a readable DCP metadata file ({error})") from None
            if not isinstance(metadata, Metadata):
                raise ValueError(f"{self.path}: its .metadata holds a {type(metadata).__name__}, not DCP metadata")
            # DCP loads a non-tensor item with torch.load(weights_only=False); tlm writes none, so none is read.
            items = metadata.state_dict_metadata.items()
            if other := sorted(key for key, item in items if not isinstance(item, TensorStorageMetadata)):
                raise ValueError(
                    f"{self.path}: its .metadata lists non-tensor items {other[:5]}; tlm writes tensors only"
                )
            storage = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
            storage.load_id = self.load_id
            metadata.storage_meta = storage
            return metadata

    return Reader(folder)


#: Each tensor of a DCP folder by its key: its size and dtype.
ShardSizes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def shard_sizes(folder: str | os.PathLike[str]) -> ShardSizes:
    """Each tensor's size and dtype as a DCP folder's metadata records them."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = shard_reader(folder).read_metadata()
    return {
        key: (tuple(item.size), item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


# ---------------------------------------------------------------------------------------------
# A step folder's model


def read_model_state(folder: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """The config and the complete model weights of a step folder, verified, in this process on the CPU:
    from its ``model.safetensors``, or gathered from a sharded folder's DCP files (what ``tlm generate``,
    ``eval`` and ``convert`` read; only the model's tensors are read, never the optimizer's)."""
    folder = Path(folder)
    if (folder / WEIGHTS_NAME).is_file():
        return read_model_file(folder)
    state, sizes = _verified_shards(folder, f"not a step folder: no {WEIGHTS_NAME} and no shards")
    config = ModelConfig.from_dict(state["model_config"])
    expected = {name: tuple(t.shape) for name, t in _course_model(config).state_dict().items()}
    got = {key[len("model.") :]: size for key, (size, _) in sizes.items() if key.startswith("model.")}
    if got != expected:  # checked before anything is allocated
        wrong = sorted(k for k in expected.keys() | got.keys() if got.get(k) != expected.get(k))
        raise ValueError(f"{folder}: the shards do not fit its model config (tensors {wrong[:5]})")
    return config, _model_tensors(folder, sizes, list(expected))


def read_sharded_tensors(folder: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every model tensor a sharded step folder holds (a LoRA run's: its adapters), verified, on the CPU."""
    folder = Path(folder)
    _, sizes = _verified_shards(folder, f"not a sharded step folder: {STATE_NAME} records no shards")
    return _model_tensors(folder, sizes, [key[len("model.") :] for key in sizes if key.startswith("model.")])


def _verified_shards(folder: Path, missing: str) -> tuple[dict[str, Any], ShardSizes]:
    """A sharded step's training state and :func:`shard_sizes`, its shard files verified first."""
    state = load_train_state(folder / STATE_NAME)
    if "shard_files" not in state:
        raise FileNotFoundError(errno.ENOENT, missing, str(folder))
    verify_shards(folder / SHARDS_DIR, state["shard_files"])
    return state, shard_sizes(folder / SHARDS_DIR)


def _model_tensors(folder: Path, sizes: ShardSizes, names: list[str]) -> dict[str, Tensor]:
    """The model tensors ``names`` of the verified shards of ``folder``, read on the CPU in one process."""
    import torch.distributed.checkpoint as dcp

    targets = {f"model.{name}": torch.empty(sizes[f"model.{name}"][0], dtype=sizes[f"model.{name}"][1])
               for name in names}  # fmt: skip
    with one_process_is_meant():
        dcp.load(targets, storage_reader=shard_reader(folder / SHARDS_DIR), no_dist=True)
    return {name: targets[f"model.{name}"] for name in names}


def _course_model(config: ModelConfig) -> nn.Module:
    return TransformerLM(config, device="meta", fused=False)


def load_whole_step(
    folder: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **options: Any,
) -> TransformerLM:
    """The TransformerLM of a step folder that holds the whole model (either layout), verified; ``dtype`` defaults
    to the saved one. ``options`` go to ``TransformerLM``. A LoRA step holds adapters only: its base is another
    artifact, which :func:`tlm_artifacts.artifact.load_step_model` opens."""
    if (Path(folder) / WEIGHTS_NAME).is_file():
        return load_model_file(folder, device=device, dtype=dtype, **options)
    config, weights = read_model_state(folder)
    saved = next(iter(weights.values())).dtype
    model = TransformerLM(config, device=device, dtype=dtype or saved, **options)
    model.load_state_dict(weights)
    return model


def read_step_config(folder: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig of a step folder (either layout), without reading the weights."""
    if (Path(folder) / WEIGHTS_NAME).is_file():
        return read_config(folder)
    return ModelConfig.from_dict(load_train_state(Path(folder) / STATE_NAME)["model_config"])
