"""Training checkpoints: one format for the training state, step folders for runs, the course's API on top.

**The training state** (``train_state.pt``) is ``torch.save`` of plain containers and tensors only, so it
loads with ``torch.load(weights_only=True)`` (no code runs at load). It carries a format tag and ends with
a one-line trailer holding the SHA-256 of every byte before it, the file's one hash (torch's zip reader
ignores it): a flipped bit anywhere in the file, zip headers and padding included, is refused.
:func:`save_train_state` writes it all-or-nothing.

**A step folder** (``RUN/checkpoints/step_00000100/``) holds the model in tlm-model's own file
(``model.safetensors``: weights, ``ModelConfig`` and their SHA-256, the same file ``tlm generate`` reads)
and ``train_state.pt`` (optimizer, schedule, sampler, RNG, step, world size), which also records the
model file's SHA-256, so a model file from another step is refused. A DDP/FSDP2 run's step folder
instead holds ``shards/``, written by torch.distributed.checkpoint with each rank writing its own part
(nothing gathered), and ``train_state.pt`` records the SHA-256 of each of those files. The folder is
built under a temporary name and renamed into place: it appears complete or not at all.
:class:`CheckpointManager` lists, loads, prunes and cleans step folders.

The read side of these formats (the training state's reader, listing step folders, a step
folder's model in either layout, DCP's metadata read safely) is ``tlm_artifacts``'s, which inference
opens models through without this package; this module imports it from there and adds the writing and
the whole training state of a resume.

**The course's** ``save_checkpoint(model, optimizer, iteration, out)`` / ``load_checkpoint(src, model,
optimizer)`` write and read one training-state file that also holds the model's state dict (any
``nn.Module``), through the same serialiser.
"""

import contextlib
import dataclasses
import hashlib
import io
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tlm_artifacts.layout import ADAPTER_NAME, LATEST_NAME, SHARDS_DIR, STATE_NAME
from tlm_artifacts.lora import adapter_bytes, file_sha256, is_adapter_key, read_adapter_file
from tlm_artifacts.steps import StepFolders
from tlm_artifacts.steps import file_digests as _file_digests
from tlm_artifacts.steps import one_process_is_meant as _one_process_is_meant
from tlm_artifacts.steps import shard_reader as _reader
from tlm_artifacts.steps import shard_sizes as _shard_sizes
from tlm_artifacts.steps import verify_shards as _verify_shards
from tlm_artifacts.train_state import FORMAT, Source, load_train_state
from tlm_artifacts.train_state import TRAILER as _TRAILER
from tlm_artifacts.train_state import check_loadable as _check_loadable
from tlm_artifacts.train_state import source_name as _name
from tlm_core.atomic import atomic_file, atomic_write, remove_leftovers, replace_dir, temp_path
from tlm_core.checks import check_int
from tlm_model import ModelConfig, save_model_file, unwrap
from tlm_model.checkpoint import read_digest, read_model_file
from tlm_train.rng import rng_state, set_rng_state

__all__ = [  # the readers of these formats are tlm_artifacts's (its .train_state and .steps): import them there
    "BackgroundSaver", "Checkpoint", "CheckpointManager", "capture_state", "load_checkpoint", "process_writer",
    "read_checkpoint", "restore_state", "save_checkpoint", "save_train_state", "stage_state",
]  # fmt: skip

# ---------------------------------------------------------------------------------------------
# The training-state format


def save_train_state(out: Source, state: dict[str, Any]) -> None:
    """Write ``state`` (plain containers, numbers, strings and tensors; ``step`` required) to ``out``, a
    path (written all-or-nothing) or a binary file, with the format tag and the SHA-256 of its bytes."""
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"state must be a dict with a 'step', got {type(state).__name__}")
    if "format" in state:
        raise ValueError("state must not set 'format': the file's own field")
    payload = {"format": FORMAT, **state}
    _check_loadable(payload)
    if not isinstance(out, (str, os.PathLike)) and not hasattr(out, "write"):
        raise TypeError(f"out must be a path or a binary file object, got {type(out).__name__}")
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    # The serialised bytes are hashed and written where torch.save left them: no copy of the whole state.
    with buffer.getbuffer() as data:
        trailer = _TRAILER + hashlib.sha256(data).hexdigest().encode() + b"\n"
        if isinstance(out, (str, os.PathLike)):
            path = Path(os.fspath(out))
            if path.is_dir():
                raise IsADirectoryError(f"out must be a file path, got the folder {path}")
            if not path.parent.is_dir():
                raise FileNotFoundError(f"cannot save {path}: the folder {path.parent} does not exist")
            with atomic_file(path) as handle:
                handle.write(data)
                handle.write(trailer)
        else:
            cast(IO[bytes], out).write(data)
            cast(IO[bytes], out).write(trailer)
            if hasattr(out, "flush"):
                out.flush()


# ---------------------------------------------------------------------------------------------
# The course's API (run_save_checkpoint / run_load_checkpoint): any module, one file


def save_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer, iteration: int, out: Source, **extra: Any
) -> None:
    """Write ``model``'s and ``optimizer``'s state, ``iteration`` and ``extra`` to ``out`` (a path or a binary
    file) in the training-state format. ``extra`` holds what a bit-exact resume needs besides the two state
    dicts (``rng=rng_state()``, ``scheduler=...``); its values must be tensors, numbers, strings, None or
    containers of them."""
    _check_pair(model, optimizer)
    check_int("iteration", iteration, low=0)
    state = {"step": iteration, "model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}
    save_train_state(out, {**state, "extra": dict(extra)})


def _check_pair(model: object, optimizer: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def read_checkpoint(src: Source) -> dict[str, Any]:
    """The checked contents of a :func:`save_checkpoint` file: ``step``, ``model``, ``optimizer``, ``extra``."""
    payload = load_train_state(src)
    if "model" not in payload or "optimizer" not in payload:
        raise ValueError(
            f"{_name(src)} holds no model state: it is a step folder's {STATE_NAME}, not a checkpoint file"
        )
    return payload


def load_checkpoint(src: Source, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore ``model`` and ``optimizer`` from ``src`` and return the saved iteration.

    Everything is checked before anything is changed: a file whose parameters or optimizer groups
    do not fit ``model``/``optimizer`` raises ``ValueError`` and leaves both as they were. Extra
    state (RNG, scheduler, sampler) is in ``read_checkpoint(src)["extra"]``.
    """
    _check_pair(model, optimizer)
    payload = read_checkpoint(src)
    name, model = _name(src), unwrap(model)
    _check_fits(name, payload["model"], model.state_dict())
    saved_groups, groups = payload["optimizer"].get("param_groups", []), optimizer.param_groups
    saved_sizes, sizes = [len(g["params"]) for g in saved_groups], [len(g["params"]) for g in groups]
    if saved_sizes != sizes:
        raise ValueError(f"{name}: the optimizer has parameter groups of sizes {sizes}, the checkpoint {saved_sizes}")
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    return int(payload["step"])


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


# ---------------------------------------------------------------------------------------------
# Capturing and restoring a (possibly sharded) model and optimizer


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_plain(model: nn.Module) -> bool:
    # One process and unsharded parameters: the module's own state dicts are already complete (and this
    # path also handles layouts torch.distributed.checkpoint cannot name, such as fused projections).
    from torch.distributed.tensor import DTensor

    return not _distributed() and not any(isinstance(p, DTensor) for p in model.parameters())


def capture_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    scheduler: Any = None,
    sampler: Any = None,
    **extra: Any,
) -> dict[str, Any]:
    """Everything a bit-exact resume needs: the model's and the optimizer's state dicts (the optimizer's
    keyed by parameter name), the scheduler's step, the sampler's state, the RNG states and the world size.

    In one process the state dicts are complete. Under DDP or FSDP2 (every rank calls this) they are
    each rank's own part, nothing gathered: FSDP2's DTensor shards, or DDP's replica, which
    torch.distributed.checkpoint writes once across the ranks; ``sharded`` is then True and
    :meth:`CheckpointManager.save` must be called on every rank."""
    sharded = not _is_plain(model)
    model_state, optim_state = model.state_dict(), _named_optimizer_state(model, optimizer)
    return {
        "sharded": sharded,
        "step": step,
        "model": model_state,
        "optimizer": optim_state,
        "scheduler": None if scheduler is None else {"last_epoch": int(scheduler.last_epoch)},
        "sampler": None if sampler is None else sampler.state_dict(),
        "rng": rng_state(),
        "world_size": dist.get_world_size() if _distributed() else 1,
        **extra,
    }


def restore_state(
    state: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Any = None,
    sampler: Any = None,
) -> int:
    """Load what :func:`capture_state` saved into the (possibly wrapped or sharded) model and optimizer,
    on any number of ranks; every rank passes the full ``state``. Returns the step.

    The optimizer's hyperparameters (lr, betas, eps, weight decay) are *not* taken from the state: the
    optimizer keeps the ones it was built with, so a resumed run applies its current settings. The
    schedule likewise keeps its own settings and takes only the step count."""
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if "shards" in state:  # a sharded step folder: each rank reads its part, resharded to this run's ranks
        _load_shards(state, model, optimizer)
    elif _is_plain(model):
        _load_model_state(model, state)
        optimizer.load_state_dict(_indexed_optimizer_state(model, optimizer, state["optimizer"]))
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict  # seconds to import

        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True, strict=not state.get("lora")),
        )
    for group, settings in zip(optimizer.param_groups, hyper, strict=True):
        group.update(settings)
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.last_epoch = int(state["scheduler"]["last_epoch"])
        lrs = scheduler.get_lr()
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        scheduler._last_lr = lrs
    if sampler is not None and state.get("sampler") is not None:
        sampler.load_state_dict(state["sampler"])
    if state.get("rng") is not None:
        set_rng_state(state["rng"])
    return int(state["step"])


def _load_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """``model.load_state_dict(state["model"])``; a LoRA state holds the adapters only, and must fill exactly
    the model's adapters (its base comes from the base model, loaded before)."""
    if not state.get("lora"):
        model.load_state_dict(state["model"])
        return
    own = {k for k in model.state_dict() if is_adapter_key(k)}
    if own != set(state["model"]):
        raise ValueError(
            f"the checkpoint's adapters do not fit the model: missing {sorted(own - set(state['model']))[:4]}, "
            f"unexpected {sorted(set(state['model']) - own)[:4]}"
        )
    model.load_state_dict(state["model"], strict=False)


def _group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of each optimizer group's parameters, in the group's order."""
    names = {id(p): name for name, p in model.named_parameters()}
    try:
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except KeyError:
        raise ValueError("optimizer holds a parameter that is not in model; pass the model it optimizes") from None


def _named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name, the layout torch.distributed.checkpoint's full
    state dicts use, so that a checkpoint from one process loads under DDP/FSDP2 and back."""
    names = [name for group in _group_names(model, optimizer) for name in group]
    saved = optimizer.state_dict()
    return {
        "state": {names[i]: value for i, value in saved["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]],
    }


def _indexed_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict:
    groups = _group_names(model, optimizer)
    index = {name: i for i, name in enumerate(name for group in groups for name in group)}
    if unknown := sorted(set(state["state"]) - set(index)):
        raise ValueError(f"checkpoint holds optimizer state for parameters the model lacks: {unknown[:5]}")
    saved = [sorted(g["params"]) for g in state["param_groups"]]
    current = [sorted(g) for g in groups]
    if saved != current:
        raise ValueError(
            "the checkpoint's optimizer groups hold other parameters than this optimizer's (sizes "
            f"{[len(g) for g in saved]} saved, {[len(g) for g in current]} now; was decay_norms changed?)"
        )
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


# ---------------------------------------------------------------------------------------------
# Sharded training state: torch.distributed.checkpoint (DCP) files inside a step folder
#
# Only tensors go through DCP (``model.<name>``, ``optimizer.<name>.<key>``): everything else (optimizer
# steps and groups, schedule, sampler, RNG) stays in train_state.pt, read with weights_only. DCP's own
# ``.metadata`` is a pickle, so it is read only after its SHA-256 matched the one train_state.pt records,
# and then by an unpickler that builds nothing but DCP's metadata classes (``tlm_artifacts.steps``, the
# reading half; the writing and the resume are here).


def _tensor_items(state: dict[str, Any]) -> dict[str, Tensor]:
    """The flat dict DCP writes: every model tensor, every tensor of the optimizer's per-parameter state."""
    items = {f"model.{name}": value for name, value in state["model"].items()}
    for name, entries in state["optimizer"]["state"].items():
        items.update({f"optimizer.{name}.{k}": v for k, v in entries.items() if isinstance(v, Tensor)})
    return items


def _without_tensors(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    state = {name: {k: v for k, v in entries.items() if not isinstance(v, Tensor)} for name, entries in
             optimizer_state["state"].items()}  # fmt: skip
    tensors = {name: sorted(k for k, v in entries.items() if isinstance(v, Tensor)) for name, entries in
               optimizer_state["state"].items()}  # fmt: skip
    return {"state": state, "tensors": tensors, "param_groups": optimizer_state["param_groups"]}


def _load_shards(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read a sharded step folder into ``model`` and ``optimizer`` as they are laid out now (FSDP2's
    shards, a DDP replica or one process): DCP reads each rank's part of every tensor."""
    import torch.distributed.checkpoint as dcp

    folder, saved = state["shards"], state["optimizer"]
    sizes = _shard_sizes(folder)
    params = dict(model.named_parameters())
    lora = bool(state.get("lora"))  # a LoRA run's shards hold its adapters only
    targets = {f"model.{k}": v for k, v in model.state_dict().items() if not lora or is_adapter_key(k)}
    if unknown := sorted(set(saved["tensors"]) - set(params)):
        raise ValueError(f"{folder} holds optimizer state for parameters the model lacks: {unknown[:5]}")
    wanted = [*targets, *(f"optimizer.{name}.{key}" for name, keys in saved["tensors"].items() for key in keys)]
    if missing := sorted(set(wanted) - set(sizes)):
        raise ValueError(f"{folder} does not fit the model: its shards lack {missing[:5]}")
    for name, keys in saved["tensors"].items():
        for key in keys:  # AdamW's moments: shaped (and under FSDP2 sharded) like their parameter
            size, dtype = sizes[f"optimizer.{name}.{key}"]
            param = params[name]
            like = size == tuple(param.shape)
            targets[f"optimizer.{name}.{key}"] = (
                torch.zeros_like(param, dtype=dtype) if like else torch.zeros(size, dtype=dtype)
            )
    with _one_process_is_meant():
        dcp.load(targets, storage_reader=_reader(folder), no_dist=not _distributed())
    model.load_state_dict(
        {name[len("model.") :]: v for name, v in targets.items() if name.startswith("model.")}, strict=not lora
    )
    named = {
        "state": {
            name: {**saved["state"].get(name, {}), **{k: targets[f"optimizer.{name}.{k}"] for k in keys}}
            for name, keys in saved["tensors"].items()
        },
        "param_groups": saved["param_groups"],
    }
    optimizer.load_state_dict(_indexed_optimizer_state(model, optimizer, named))


# ---------------------------------------------------------------------------------------------
# Step folders


@dataclasses.dataclass
class Checkpoint:
    """A verified step folder: its model file and its training state (``state["model"]`` is the model's
    state dict read from ``model.safetensors``; a sharded folder's ``state["shards"]`` is instead the
    folder of DCP files that :func:`restore_state` reads and ``tlm_artifacts.steps.read_model_state`` gathers)."""

    step: int
    path: Path
    config: ModelConfig
    state: dict[str, Any]


def stage_state(state: Any, buffers: list[Tensor] | None = None) -> tuple[Any, Any]:
    """A snapshot of ``state`` (nested dicts, lists and tensors) whose tensors live on the host, and an event
    to wait on before reading it (None when nothing was copied from an accelerator).

    CPU tensors are cloned; accelerator tensors copied without blocking into pinned host memory, so training
    goes on while the copies run (the device's stream orders them before any later update). A tensor that
    appears twice (a tied weight) stays one tensor. ``buffers``, a list kept between calls, is reused for the
    pinned copies when the shapes agree (one snapshot in flight at a time)."""
    seen: dict[int, Tensor] = {}
    pinned = iter(list(buffers)) if buffers is not None else iter(())
    fresh: list[Tensor] = []
    accelerator = None

    def copy(value: Any) -> Any:
        nonlocal accelerator
        if isinstance(value, Tensor):
            if id(value) in seen:
                return seen[id(value)]
            source = value.detach()
            if source.device.type == "cpu":
                out = source.clone()
            else:
                accelerator = source.device
                reuse = next(pinned, None)
                if reuse is not None and reuse.shape == source.shape and reuse.dtype == source.dtype:
                    out = reuse
                else:
                    out = torch.empty(source.shape, dtype=source.dtype, pin_memory=torch.cuda.is_available())
                out.copy_(source, non_blocking=True)
                fresh.append(out)
            seen[id(value)] = out
            return out
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, list):
            return [copy(v) for v in value]
        if isinstance(value, tuple):
            return tuple(copy(v) for v in value)
        return value

    staged = copy(state)
    if buffers is not None and fresh:
        buffers[:] = fresh
    event = None
    if accelerator is not None and accelerator.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(accelerator))
    return staged, event


def _check_writer(writer: object) -> str:
    if writer not in ("auto", "process", "thread"):
        raise ValueError(f"writer must be 'auto', 'process' or 'thread', got {writer!r}")
    return str(writer)


def process_writer(writer: str = "auto", *, accelerator: bool = True) -> Any:
    """DCP's ``AsyncCheckpointerType.PROCESS`` when a sharded save's files should be written by DCP's writer
    process, else None (DCP's writer thread).

    ``writer`` is ``"process"``, ``"thread"`` or ``"auto"``. A writer process (torchtitan's choice) serialises and
    writes in its own interpreter, so the training's threads never wait for it on the GIL; it needs a process
    group (DCP starts it with one gloo group of its own) and a torch whose ``async_save`` takes
    ``async_checkpointer_type`` (feature-detected: None otherwise, whatever ``writer`` says). DCP starts it with
    ``spawn``, which imports the program's main script again in the new process: a script whose training is
    not under ``if __name__ == "__main__":`` would train again in it and hang. ``"auto"`` therefore takes the
    process only where that import is harmless (:func:`_main_is_spawn_safe`), and only for a state on an
    ``accelerator``: a CPU run's cores are the training's, which a writer process takes as a thread would, plus
    the copy into it (docs/benchmarks.md: slower than the thread on 2 CPU ranks)."""
    _check_writer(writer)
    if writer == "thread" or not _distributed():
        return None
    try:  # feature detection: the packages' torch floor may lack it
        import inspect

        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save
    except ImportError:
        return None
    kind = getattr(AsyncCheckpointerType, "PROCESS", None)
    if kind is None or "async_checkpointer_type" not in inspect.signature(async_save).parameters:
        return None
    if writer == "auto" and not (accelerator and _main_is_spawn_safe()):
        return None
    return kind


def _main_is_spawn_safe() -> bool:
    """Whether multiprocessing's ``spawn`` can import this program's ``__main__`` in a new process without running
    its work: ``python -c``/a REPL (no file), ``python -m pkg``/``torchrun -m tlm`` (a ``__main__`` module, which
    spawn skips), or a script (the ``tlm`` console script included) whose top level holds an
    ``if __name__ == "__main__":`` block."""
    import ast
    import sys

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return True
    path = getattr(main, "__file__", None) if name is None else getattr(spec, "origin", None)
    if path is None:
        return name is None  # -c or a REPL: nothing to import; a module without a file: unknown
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False

    def guard(node: ast.stmt) -> bool:
        test = getattr(node, "test", None)
        if not isinstance(node, ast.If) or not isinstance(test, ast.Compare) or len(test.comparators) != 1:
            return False
        sides = {ast.dump(test.left), ast.dump(test.comparators[0])}
        return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}

    return any(guard(node) for node in tree.body)


def _stop_writer_process() -> None:
    """End DCP's writer process, which torch keeps in a module global for the interpreter's life: the next
    run of this interpreter, perhaps over another process group, starts its own. (Feature-detected: a torch
    without it has nothing to end.)"""
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor
    except ImportError:
        return
    process = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if process is None:
        return
    executor._CHECKPOINT_PROCESS = None
    with contextlib.suppress(Exception):
        process.__del__()  # sends TERMINATE, joins, and SIGTERMs a process that lingers


class BackgroundSaver:
    """Writes checkpoints in the background, one at a time, so a save costs the training loop a copy of the
    state to host memory instead of serialising and hashing everything. A one-process state is staged here
    (:func:`stage_state`) and :meth:`CheckpointManager.save` runs unchanged on a writer thread. A sharded one
    (every rank calls :meth:`submit`) goes through ``dcp.async_save`` (:meth:`CheckpointManager.start_shards`),
    over a gloo group made for checkpoints on the first such save: staged on DCP's staging thread, written by
    DCP's writer process where :func:`process_writer` (``writer``; by default for an accelerator's state) picks
    one, else by DCP's thread, and finished
    (hashes, ``train_state.pt``, the rename into place) by the writer thread here. Either way the step folder
    appears complete or not at all, and only this process puts it in place: a writer process left behind by a
    killed run finishes the save in flight into its temporary folder (which ``remove_leftovers`` takes) and
    exits when it finds its parent gone. A writer's error is raised by the next :meth:`wait`."""

    def __init__(self, writer: str = "auto") -> None:
        self.writer = _check_writer(writer)
        self._spawned = False  # whether a save of ours went to DCP's writer process (ended by close())
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: list[Tensor] = []
        self._group: Any = None  # the sharded saves' own process group
        self._stager: Any = None  # DCP's stager, kept for an accelerator's pinned buffers
        self._staging: Any = None  # the sharded save's staging future (DCP's async staging), until waited for

    def submit(self, manager: "CheckpointManager", model: nn.Module, state: dict[str, Any]) -> Path:
        """Stage ``state`` and start writing it; returns the step folder it will be (after waiting for the
        previous save)."""
        self.wait()
        if state.get("sharded"):
            accelerator = any(t.device.type != "cpu" for t in _tensor_items(state).values())
            writer = process_writer(self.writer, accelerator=accelerator)
            stager, own = self._shard_stager(accelerator, shared=writer is not None)
            folder, finish, self._staging = manager.start_shards(
                model, state, process_group=self._shard_group(), stager=stager, asynchronous=True, checkpointer=writer
            )
            self._spawned = self._spawned or writer is not None

            def work() -> None:
                try:
                    finish()
                finally:
                    if own and stager is not None:
                        stager.close()

        else:
            staged, event = stage_state(state, self._buffers)
            folder = manager.path(state["step"])

            def work() -> None:
                if event is not None:
                    event.synchronize()
                manager.save(model, staged)

        def write() -> None:
            try:
                work()
            except BaseException as err:  # raised in the training thread by wait()
                self._error = err

        self._thread = threading.Thread(target=write, name="tlm-checkpoint-writer", daemon=True)
        self._thread.start()
        return folder

    def _shard_group(self) -> Any:
        # DCP's collectives run on its writer thread: on the training's group they could interleave with the
        # training's own collectives in a different order on each rank. gloo: async_save needs a CPU group.
        if self._group is None and _distributed():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _shard_stager(self, accelerator: bool, *, shared: bool = False) -> tuple[Any, bool]:
        """DCP's stager for this save (None where this torch has no ``DefaultStager``: ``async_save`` then stages
        before it returns), and whether it is this save's own (closed once written). For a state on an
        ``accelerator`` one stager is kept, so its pinned host buffers are reused; on a CPU each save copies
        afresh and the copy is freed once written. Staging is asynchronous (DCP's thread, on an accelerator its
        own stream): the training goes on, and :meth:`wait_staged` is called before the weights next change.
        ``shared``: the copy goes to shared memory, which DCP's writer process reads without another copy."""
        try:  # a newer torch's (feature detection: the packages' torch floor may lack it)
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:
            return None, False
        options = StagingOptions(use_pinned_memory=accelerator and torch.cuda.is_available(), use_shared_memory=shared,
                                 use_async_staging=True, use_non_blocking_copy=accelerator)  # fmt: skip
        if not accelerator:
            return DefaultStager(options), True
        if self._stager is None:
            self._stager = DefaultStager(options)
        return self._stager, False

    def wait_staged(self) -> None:
        """Block until the sharded save in flight has copied the state it saves (DCP's async staging): call it
        before the weights or the optimizer state change. Its error, if any, is raised by :meth:`wait`."""
        staging, self._staging = self._staging, None
        if staging is not None:
            with contextlib.suppress(Exception):  # the writer's finish() raises it, once
                staging.result()

    def idle(self) -> bool:
        """Whether no save is being written (a finished one's error is still raised by :meth:`wait`)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight is written; raise its error, if it had one."""
        self.wait_staged()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """:meth:`wait`, then release the staging buffers kept between saves (an accelerator's pinned ones)."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            self._buffers = []
            if self._spawned:
                self._spawned = False
                _stop_writer_process()


class CheckpointManager(StepFolders):
    """Step folders in ``directory``: ``step_00000100/{model.safetensors, train_state.pt}``, and ``latest``
    naming the newest one saved.

    :meth:`save` writes a folder all-or-nothing; :meth:`load` verifies both files (their SHA-256s and
    that they belong together); :meth:`load_latest` returns the newest folder that verifies, passing
    over (and reporting) damaged ones; :meth:`prune` keeps the ``keep`` newest complete folders and never
    the newest one; :meth:`remove_leftovers` deletes what killed writers left behind.
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2) -> None:
        super().__init__(directory)
        self.keep = check_int("keep", keep, low=1)

    def save(self, model: nn.Module, state: dict[str, Any]) -> Path:
        """Write ``state`` (from :func:`capture_state`: its ``model`` entry is the model's state dict) as the
        folder of ``state["step"]``; returns it. A ``sharded`` state is written by every rank at once (call
        this on each): see :meth:`_save_shards`."""
        step = check_int("state['step']", state.get("step"), low=0)
        if state.get("sharded"):
            return self._save_shards(model, state)
        weights = state["model"]
        rest = {k: v for k, v in state.items() if k != "model"}
        self.directory.mkdir(parents=True, exist_ok=True)

        def fill(folder: Path) -> None:
            if state.get("lora"):  # the adapters only; train_state.pt names the base
                data = adapter_bytes(weights)
                with atomic_file(folder / ADAPTER_NAME) as handle:
                    handle.write(data)
                save_train_state(folder / STATE_NAME, {**rest, "adapter_sha256": file_sha256(data)})
                return
            save_model_file(model, folder, state_dict=weights)
            save_train_state(folder / STATE_NAME, {**rest, "model_sha256": read_digest(folder)})

        return self._point_at(replace_dir(self.path(step), fill))

    def _save_shards(self, model: nn.Module, state: dict[str, Any]) -> Path:
        """Each rank writes its own part of the model and optimizer into one temporary folder (DCP: no
        rank gathers either); then rank 0 records every file's SHA-256 in ``train_state.pt``, written
        last, and puts the folder in place, and every rank waits for that."""
        folder, finish, _ = self.start_shards(model, state)
        finish()
        if _distributed():
            dist.barrier()
        return folder

    def start_shards(
        self,
        model: nn.Module,
        state: dict[str, Any],
        *,
        process_group: Any = None,
        stager: Any = None,
        asynchronous: bool = False,
        checkpointer: Any = None,
    ) -> tuple[Path, Callable[[], None], Any]:
        """Begin a sharded save on every rank; returns the step folder it will be, ``finish``, which completes
        it (on rank 0: the shard files' SHA-256s, ``train_state.pt`` and the rename into place), and the
        staging future (None when the state was staged before this returned).

        Without ``stager`` or ``asynchronous`` the shards are written here (``dcp.save``). Otherwise each rank's
        part is written by ``dcp.async_save`` on DCP's thread over ``process_group`` (a CPU group of the
        checkpoint's own), staged to host memory by ``stager`` (a DCP ``AsyncStager``; with async staging the
        copy runs on DCP's thread too, and the staging future says when it is done) or, without one, before
        ``async_save`` returns; ``finish`` then waits for it, and raises its error. ``checkpointer`` is DCP's
        ``AsyncCheckpointerType`` for ``async_save`` (None: its default, a thread; ``PROCESS``: DCP's writer process,
        see :func:`process_writer`). On rank 0, DCP's future is done only once every rank's files and the metadata
        are written."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        step = state["step"]
        tensors = _tensor_items(state)
        rest = {k: v for k, v in state.items() if k not in ("model", "optimizer", "sharded")}
        rest["optimizer"] = _without_tensors(state["optimizer"])
        rest["model_config"] = cast(Any, unwrap(model)).config.to_dict()
        rank = dist.get_rank() if _distributed() else 0
        staging: Path | None = None
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            staging = temp_path(self.path(step))  # a kill's leftover: remove_leftovers takes it
            os.mkdir(staging, 0o777)
        shards = Path(_share([None if staging is None else str(staging)])[0]) / SHARDS_DIR
        writer = FileSystemWriter(shards)
        future: Any = None
        staged: Any = None
        try:
            with _one_process_is_meant(), _dcp_errors(step):
                if stager is None and not asynchronous:
                    dcp.save(tensors, storage_writer=writer, no_dist=not _distributed())
                else:
                    rest = stage_state(rest)[0]  # what DCP does not stage: training goes on and changes it
                    if any(t.device.type == "cuda" for t in tensors.values()):
                        # DCP's staging stream does not wait for the training's: the last update must be done.
                        torch.cuda.current_stream().synchronize()
                    kwargs: dict[str, Any] = {} if stager is None else {"async_stager": stager}
                    if checkpointer is not None:
                        kwargs["async_checkpointer_type"] = checkpointer
                    response = dcp.async_save(
                        tensors, storage_writer=writer, no_dist=not _distributed(), process_group=process_group,
                        **kwargs,
                    )  # fmt: skip
                    # An AsyncSaveResponse with async staging (staging and upload futures), else one future.
                    future = getattr(response, "upload_completion", response)
                    staged = getattr(response, "staging_completion", None)
        except BaseException:
            if staging is not None:
                _remove_tree(staging)
            raise

        def finish() -> None:
            try:
                if future is not None:
                    with _dcp_errors(step):
                        future.result()
                if staging is None:
                    return

                def fill(folder: Path) -> None:
                    os.rename(shards, folder / SHARDS_DIR)
                    save_train_state(folder / STATE_NAME, {**rest, "shard_files": _file_digests(folder / SHARDS_DIR)})

                self._point_at(replace_dir(self.path(step), fill))
            finally:
                if staging is not None:
                    _remove_tree(staging)

        return self.path(step), finish, staged

    def load(self, step: int) -> Checkpoint:
        """The verified contents of step ``step``'s folder; ``ValueError`` naming what is wrong. A sharded
        folder's shards are verified here and read by :func:`restore_state` (``state["shards"]``)."""
        folder = self.path(step)
        if not folder.is_dir():
            raise FileNotFoundError(f"no checkpoint folder for step {step}: {folder}")
        with _reading(folder):  # a prune in another process passes over it until this returns
            return self._load(step, folder)

    def _load(self, step: int, folder: Path) -> Checkpoint:
        state = load_train_state(folder / STATE_NAME)
        if "shard_files" in state:
            _verify_shards(folder / SHARDS_DIR, state["shard_files"])
            state["shards"] = str(folder / SHARDS_DIR)
            config = ModelConfig.from_dict(state["model_config"])
        elif "adapter_sha256" in state:  # a LoRA run's step: adapters, with the base named in the state
            state["model"] = read_adapter_file(folder / ADAPTER_NAME, state["adapter_sha256"])
            config = ModelConfig.from_dict(state["model_config"])
        else:
            config, state["model"] = read_model_file(folder)  # verifies the model file's SHA-256
            if state.get("model_sha256") != read_digest(folder):
                raise ValueError(f"{folder}: {STATE_NAME} belongs to another model file (its recorded SHA-256 differs)")
        if state.get("step") != step:
            raise ValueError(f"{folder}: {STATE_NAME} says step {state.get('step')}, the folder step {step}")
        return Checkpoint(step, folder, config, state)

    def load_latest(self, on_damaged: Callable[[int, Exception], None] | None = None) -> Checkpoint | None:
        """The newest step folder that verifies, or None when there is none. ``on_damaged(step, error)`` is
        told about each newer folder passed over. A folder removed while this reads (a concurrent prune)
        is not damage: the listing is read again."""
        for _ in range(10):
            listed = self.steps()
            for step in reversed(listed):
                try:
                    return self.load(step)
                except FileNotFoundError:
                    break  # pruned under us: list again
                except (ValueError, OSError, RuntimeError) as err:
                    if on_damaged is not None:
                        on_damaged(step, err)
            else:
                if self.steps() == listed:
                    return None
        return None

    def prune(self) -> list[int]:
        """Delete all but the ``keep`` newest complete folders (never the newest); returns the steps removed."""
        pointed = self._pointer()  # the newest save: a racing listing relies on it, so it stays
        doomed = [step for step in self.steps()[: -self.keep] if step != pointed]
        # A folder another process is reading (load holds a shared lock on it) is left to the next prune.
        return [step for step in doomed if _remove_folder(self.path(step), wait=False)]

    def remove_after(self, step: int) -> list[int]:
        """Delete every step folder after ``step`` (a resume from ``step`` abandons them); returns them."""
        removed = [s for s in self.all_steps() if s > step]
        for s in removed:
            _remove_folder(self.path(s))
        if removed and (kept := self._listed()):
            self._point_at(self.path(max(kept)))
        return removed

    def _point_at(self, folder: Path) -> Path:
        """Name ``folder`` in ``latest``: after the folder is in place and before any prune, so a listing that
        races both still finds a step."""
        atomic_write(self.directory / LATEST_NAME, f"{folder.name}\n")
        return folder

    def remove_leftovers(self) -> list[Path]:
        """Delete the temporary folders of saves that were killed (never a live writer's)."""
        return remove_leftovers(self.directory)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _dcp_errors(step: int) -> Iterator[None]:
    """DCP's failure of a save (a ``CheckpointException``, a BaseException holding every failed rank's error)
    as one clear error: an OSError when the first rank's cause was one (a full disk), else a RuntimeError."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        failures = sorted(err.failures.items())
        first = failures[0][1]
        cause = first[0] if isinstance(first, tuple) else first
        ranks = ", ".join(str(rank) for rank, _ in failures)
        message = f"the checkpoint of step {step} was not written: rank {ranks} failed: {type(cause).__name__}: {cause}"
        if isinstance(cause, OSError):
            raise OSError(cause.errno, message) from err
        raise RuntimeError(message) from err


def _share(values: list[Any]) -> list[Any]:
    """Rank 0's ``values`` on every rank (unchanged in one process)."""
    if _distributed():
        dist.broadcast_object_list(values, src=0)
    return values


def _remove_folder(folder: Path, *, wait: bool = True) -> bool:
    """Delete a step folder, once no reader holds it (``wait=False``: False at once when one does)."""
    import shutil

    try:
        fd = os.open(folder, _FOLDER_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return True
    try:
        if not _lock_folder(fd, shared=False, wait=wait):
            return False
        # Renamed away first, so a reader never sees a half-deleted step folder under its real name.
        doomed = temp_path(folder, "old")
        try:
            os.rename(folder, doomed)
        except FileNotFoundError:
            return True
        shutil.rmtree(doomed, ignore_errors=True)
        return True
    finally:
        os.close(fd)


_FOLDER_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _lock_folder(fd: int, *, shared: bool, wait: bool) -> bool:
    """``flock`` the step folder open at ``fd``: True once held, False when ``wait=False`` and another
    process holds it. Where the platform has no ``flock`` (Windows), always True: nothing is held."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no advisory locks: a prune may take a folder being read
        return True
    mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, mode)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def _reading(folder: Path) -> Iterator[None]:
    """A shared lock on ``folder`` while it is read: :meth:`CheckpointManager.prune` in another process
    leaves a folder held so until the next prune. FileNotFoundError when the folder was pruned first."""
    try:
        fd = os.open(folder, _FOLDER_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"no checkpoint folder {folder} (removed while it was read)") from None
    try:
        _lock_folder(fd, shared=True, wait=True)  # a prune holds it only while it renames the folder away
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(folder, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if not same:  # pruned (renamed away) between the open and the lock
            raise FileNotFoundError(f"no checkpoint folder {folder} (removed while it was read)")
        yield
    finally:
        os.close(fd)
