"""LoRA runs and PEFT adapters, read: what a step folder of a ``--lora-rank`` run holds, and how to open one.

A LoRA run's step folder holds ``adapter.safetensors`` (the adapters, keyed by parameter name) instead of
``model.safetensors``, and its ``train_state.pt`` records the adapters' SHA-256, the LoRA settings and the
base's identity: the path ``--init-from`` named and the SHA-256 of the base's weights
(:func:`tlm_lora.weights_sha256`, the same whatever file format the base was read from). Opening one reads
the base again, refuses it when its weights changed, applies the adapters and (for inference) merges them:
:mod:`tlm_artifacts.artifact` reads the base (it is any artifact, so it is opened beside ``resolve``), and this
module, which handles adapters and their files only, applies them (:func:`with_adapters`).

A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) opens the same way, with its
base taken from ``base_model_name_or_path`` (relative to the adapter folder when relative). The adapter
files' formats (:func:`adapter_bytes`, :func:`peft_config`) are defined here once, for ``tlm train`` and
``tlm convert --to-peft`` to write.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tlm_artifacts.layout import PEFT_CONFIG, PEFT_WEIGHTS
from tlm_core.atomic import read_input
from tlm_core.checks import check_number
from tlm_lora import apply_lora, load_lora_state_dict, merge_lora
from tlm_model import ModelConfig, TransformerLM

#: PEFT's module names of tlm's roles (target_modules of an HF Llama).
PEFT_MODULE_OF_ROLE = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "w1": "gate_proj",
    "w2": "down_proj",
    "w3": "up_proj",
    "lm_head": "lm_head",
}


class BaseModelError(ValueError):
    """The base model a LoRA run or PEFT adapter names is gone or is not the one it was trained on: no older
    step of the run would do better, so it is not a damaged checkpoint."""


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def adapt(model: nn.Module, lora: dict[str, Any], *, seed: int | None = None) -> None:
    """Apply the adapters ``lora`` (from :func:`settings`) to ``model``; ``seed`` draws their A matrices
    without touching the global RNG streams."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        apply_lora(model, lora["targets"], rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"])


def grown(weights: dict[str, Tensor], vocab_size: int) -> dict[str, Tensor]:
    """``weights`` with the embedding and LM head grown to ``vocab_size`` rows, each new row the mean of the
    old ones (transformers' ``resize_token_embeddings(mean_resizing=True)``): new tokens start as an average."""
    out = dict(weights)
    for name in ("token_embeddings.weight", "lm_head.weight"):
        table = out.get(name)
        if table is not None and table.shape[0] < vocab_size:
            extra = table.mean(dim=0, keepdim=True).expand(vocab_size - table.shape[0], -1)
            out[name] = torch.cat([table, extra])
    return out


def file_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def adapter_bytes(adapters: dict[str, Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in adapters.items()}, metadata={"format": "pt"})


def read_adapter_file(path: Path, sha256: str) -> dict[str, Tensor]:
    """The adapters of a LoRA step folder, refused unless the file's bytes match the recorded SHA-256."""
    data = read_input(path, "adapter file")
    if file_sha256(data) != sha256:
        raise ValueError(f"{path} is corrupt or from another step: its SHA-256 differs from the one recorded")
    return tensors_of(data, path)


def tensors_of(data: bytes, path: Path) -> dict[str, Tensor]:
    """The tensors of safetensors bytes read from ``path``; a truncated or garbage file is a ValueError naming it
    (safetensors raises its own ``SafetensorError``)."""
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as err:  # SafetensorError, and whatever a header that parses but lies raises
        raise ValueError(f"{path} is not a readable safetensors file ({str(err).splitlines()[0][:200]})") from None


def with_adapters(
    base: TransformerLM,
    state: dict[str, Any],
    adapters: dict[str, Tensor],
    what: str,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    merge: bool = True,
    **options: Any,
) -> TransformerLM:
    """A LoRA step's model from its verified ``base`` and ``adapters`` (keyed by parameter name), as its training
    state ``state`` built it: merged unless ``merge`` is False, when the LoRALinear modules stay in place, as a
    PEFT export wants them. :func:`tlm_artifacts.artifact.load_lora_step` reads the base and the adapters."""
    config = ModelConfig.from_dict(state["model_config"])
    model = TransformerLM(config, **{**options, "fused": False})  # unfused, as training built it
    model.load_state_dict(grown(base.state_dict(), config.vocab_size))  # a chat run's markers, as in training
    adapt(model, state["lora"])
    load_named_adapters(model, adapters, what)
    return _finished(model, merge, device, dtype, options)


def _finished(model: TransformerLM, merge: bool, device: Any, dtype: Any, options: dict[str, Any]) -> TransformerLM:
    """An adapted model for inference: with ``merge``, a plain ``TransformerLM`` (built with ``options``) holding
    the merged weights; else the adapted model itself, on ``device`` in ``dtype``."""
    if merge:
        merge_lora(model)
        plain = TransformerLM(model.config, device=device, dtype=dtype, **options)
        plain.load_state_dict({k: v for k, v in model.state_dict().items() if not is_adapter_key(k)})
        return plain.eval()
    return model.to(device=device, dtype=dtype).eval()


def load_named_adapters(model: nn.Module, adapters: dict[str, Tensor], what: str) -> None:
    """Load adapters keyed by parameter name (a training checkpoint's) into ``model``, all or nothing."""
    own = {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}
    if set(own) != set(adapters) or any(own[k].shape != adapters[k].shape for k in own):
        raise ValueError(f"{what}: its adapters do not fit the model their settings build")
    with torch.no_grad():
        for key, value in adapters.items():
            own[key].copy_(value)


# ---------------------------------------------------------------------------------------------
# PEFT adapter folders


def is_peft_folder(path: Path) -> bool:
    return path.is_dir() and (path / PEFT_CONFIG).is_file() and (path / PEFT_WEIGHTS).is_file()


def peft_base_path(folder: Path) -> Path:
    """The base model folder a PEFT adapter names (``base_model_name_or_path``, relative to the adapter)."""
    config = _peft_config(folder)
    name = config.get("base_model_name_or_path")
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"{folder / PEFT_CONFIG} names no base_model_name_or_path: tlm cannot tell which base it adapts"
        )
    base = Path(name) if os.path.isabs(name) else folder / name
    if not base.exists():
        raise FileNotFoundError(f"{folder}: its base model {name} is not there (looked for {base})")
    return base


def _peft_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads(read_input(folder / PEFT_CONFIG, "PEFT adapter config"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{folder / PEFT_CONFIG} is not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{folder / PEFT_CONFIG} holds a JSON {type(config).__name__}, not an adapter config")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{folder / PEFT_CONFIG}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    return config


def peft_settings(folder: Path) -> dict[str, Any]:
    """tlm's LoRA settings for a PEFT LoRA adapter; what tlm cannot reproduce is refused by name."""
    config = _peft_config(folder)
    used = {
        "use_dora": bool(config.get("use_dora")),
        "use_rslora": bool(config.get("use_rslora")),
        "bias": config.get("bias", "none") not in ("none", None),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "layers_to_transform": config.get("layers_to_transform") is not None,
        "lora_bias": bool(config.get("lora_bias")),
        "trainable_token_indices": bool(config.get("trainable_token_indices")),
        "layer_replication": bool(config.get("layer_replication")),
        "target_parameters": bool(config.get("target_parameters")),
    }
    if unsupported := [key for key, on in used.items() if on]:
        raise ValueError(f"{folder / PEFT_CONFIG}: PEFT options tlm does not reproduce: {unsupported}")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    roles = {peft: role for role, peft in PEFT_MODULE_OF_ROLE.items()}
    if unknown := [n for n in names if n not in roles]:
        raise ValueError(f"{folder / PEFT_CONFIG}: target_modules {unknown} are not Llama projections tlm adapts")
    if not names:
        raise ValueError(f"{folder / PEFT_CONFIG}: target_modules is empty: it names no projection to adapt")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if type(rank) is not int or rank < 1 or isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{folder / PEFT_CONFIG}: r must be a positive int and lora_alpha a number, got {rank!r}, "
                         f"{alpha!r}")  # fmt: skip
    try:  # here, under the file's name: tlm_lora's own checks say "alpha must be ...", naming no file
        alpha = check_number("lora_alpha", alpha, low=0.0, low_open=True)
        dropout = check_number("lora_dropout", config.get("lora_dropout", 0.0), low=0.0, high=1.0, high_open=True)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{folder / PEFT_CONFIG}: {err}") from None
    return {"rank": rank, "alpha": alpha, "targets": ",".join(roles[n] for n in names), "dropout": dropout}


def with_peft_adapter(
    base: TransformerLM,
    folder: Path,
    lora: dict[str, Any],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    merge: bool = True,
    **options: Any,
) -> TransformerLM:
    """``base`` with the PEFT LoRA adapter in ``folder`` applied (``lora``: its :func:`peft_settings`), merged unless
    ``merge`` is False. :func:`tlm_artifacts.artifact.load_peft` reads the base the adapter names."""
    from tlm_model.interop import from_hf_lora_state_dict

    # Checked before anything is allocated: an absurd r (10**9) would ask the allocator for terabytes. No LoRA
    # update of a projection has a rank above its smaller side, which is at most d_model for every target.
    if lora["rank"] > base.config.d_model:
        raise ValueError(f"{folder / PEFT_CONFIG}: r {lora['rank']} is more than the base's d_model "
                         f"{base.config.d_model}: no projection it adapts has a rank that high")  # fmt: skip
    weights = tensors_of(read_input(folder / PEFT_WEIGHTS, "PEFT adapter weights"), folder / PEFT_WEIGHTS)
    model = TransformerLM(base.config, **{**options, "fused": False})
    model.load_state_dict(base.state_dict())
    adapt(model, lora)
    try:
        load_lora_state_dict(model, from_hf_lora_state_dict(weights, base.config))
    except (KeyError, RuntimeError, ValueError) as err:  # names or shapes that the config's adapters lack
        raise ValueError(f"{folder / PEFT_WEIGHTS}: its tensors do not fit the adapter {PEFT_CONFIG} describes "
                         f"({str(err).splitlines()[0][:200]})") from None  # fmt: skip
    return _finished(model, merge, device, dtype, options)


def peft_config(lora: dict[str, Any], base: str) -> dict[str, Any]:
    """The ``adapter_config.json`` of tlm's LoRA settings on an HF Llama at ``base``."""
    from tlm_lora import check_targets

    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": [PEFT_MODULE_OF_ROLE[r] for r in check_targets(lora["targets"])],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
