"""Save a TransformerLM to a directory and load it back: ``model.safetensors`` + ``config.json``.

The weights file holds the model's state dict under the course's keys (``token_embeddings.weight``,
``layers.{i}.attn.q_proj.weight``, ...), each tensor in the dtype it had; ``config.json`` holds
``ModelConfig.to_dict()`` plus ``"format"``, the version of this layout. safetensors stores raw
tensors and a JSON header only, so loading a checkpoint never runs code (unlike ``torch.load``).
"""

import dataclasses
import errno
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tlm_model.config import ModelConfig
from tlm_model.lm import TransformerLM

FORMAT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def save_checkpoint(model: torch.nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write ``model``'s weights and config into ``directory`` (created if needed); return its path.

    Existing files of the same names are replaced; each is written to a temporary name first and
    renamed, so an interrupted save never leaves a truncated file under the real name.
    """
    # A torch.compile'd model wraps the real one; save that, under the plain keys.
    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    tensors = _contiguous_unshared(model.state_dict())
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"format": FORMAT_VERSION, **model.config.to_dict()}

    weights_tmp = directory / (WEIGHTS_NAME + ".tmp")
    save_file(tensors, str(weights_tmp), metadata={"format": "pt"})
    os.replace(weights_tmp, directory / WEIGHTS_NAME)
    config_tmp = directory / (CONFIG_NAME + ".tmp")
    config_tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    os.replace(config_tmp, directory / CONFIG_NAME)
    return directory


def _contiguous_unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors that share storage (tied or fused weights exposed as views) and
    # non-contiguous ones: keep the first tensor of each storage, clone the others.
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[torch.device, int]] = set()
    for name, tensor in state.items():
        tensor = tensor.detach()
        if tensor.is_meta:
            raise ValueError(
                f"cannot save {name}: it is on the meta device (no data); materialise the model first "
                f"with to_empty() and reset_parameters() or load_state_dict()"
            )
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        if storage in seen:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        else:
            seen.add(storage)
            tensor = tensor.contiguous()
        out[name] = tensor
    return out


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    config: ModelConfig | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **options: Any,
) -> TransformerLM:
    """Build the TransformerLM saved in ``directory`` and load its weights (``strict=True``).

    ``config``, when given, must equal the saved one; otherwise ``ValueError`` names every field
    that differs. ``dtype`` defaults to the dtype the weights were saved in, so a float32 or
    bfloat16 model reloads bit for bit; ``device`` defaults to torch's default device.

    ``options`` (e.g. ``fused=``, ``attention_backend=``) go to ``TransformerLM.from_config``. They
    are not saved: they change how the model computes, not what it is, and the weights load into
    any of them. Logits are bit-identical to the saved model's when it was built with the same
    options (the defaults, unless you chose others); otherwise they agree up to float rounding.
    """
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(
                errno.ENOENT,
                f"not a tlm checkpoint: missing {path.name} (save_checkpoint writes both "
                f"{CONFIG_NAME} and {WEIGHTS_NAME})",
                str(path),
            )
    saved = _read_config(config_path)
    if config is not None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig or None, got {type(config).__name__}")
        _check_same(saved, config)

    try:
        state = load_file(str(weights_path))
    except SafetensorError as err:
        raise ValueError(f"{weights_path} is not a readable safetensors file: {err}") from err
    if dtype is None:
        dtype = _saved_dtype(state, weights_path)
    model = TransformerLM.from_config(saved, device=device, dtype=dtype, **options)
    # strict=True: a missing, unexpected or wrongly shaped tensor raises torch's RuntimeError.
    model.load_state_dict(state, strict=True)
    return model


def _read_config(path: Path) -> ModelConfig:
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    if "format" not in data:
        raise ValueError(f'{path} has no "format" field, so save_checkpoint did not write it')
    version = data.pop("format")
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise ValueError(f'{path} has "format": {version!r}; this tlm-model reads checkpoint format {FORMAT_VERSION}')
    try:
        return ModelConfig.from_dict(data)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{path}: {err}") from err


def _check_same(saved: ModelConfig, requested: ModelConfig) -> None:
    differences = []
    for field in dataclasses.fields(ModelConfig):
        have, want = getattr(saved, field.name), getattr(requested, field.name)
        if have != want:
            differences.append(f"{field.name} is {have!r} in the checkpoint but {want!r} requested")
    if differences:
        raise ValueError("checkpoint config mismatch: " + "; ".join(differences))


def _saved_dtype(state: dict[str, torch.Tensor], path: Path) -> torch.dtype:
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) > 1:
        names = sorted(str(d) for d in dtypes)
        raise ValueError(f"{path} holds tensors of several dtypes {names}; pass dtype= to choose one")
    return dtypes.pop() if dtypes else torch.get_default_dtype()
