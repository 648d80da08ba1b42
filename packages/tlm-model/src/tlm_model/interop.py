"""Convert between tlm's ``TransformerLM`` and HF transformers' ``LlamaForCausalLM``.

The architectures are the same except for RoPE's pairing: tlm rotates interleaved pairs
(x[2k], x[2k+1]) as in the RoPE paper and Meta's LLaMA code, HF rotates (x[k], x[k + d/2])
("rotate-half"). Reordering the rows of each head's q and k projections maps one onto the other;
q·k is unchanged because both move together. Nothing here imports transformers: the HF folder
(``config.json`` + ``model.safetensors`` or a sharded ``model.safetensors.index.json``) is read and
written directly, and anything tlm cannot represent is refused by name, never dropped.
"""

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tlm_model import checkpoint as _ckpt
from tlm_model.config import ModelConfig
from tlm_model.lm import TransformerLM, unwrap
from tlm_rope import SCALINGS

_BLOCK = {  # tlm key inside a layer -> HF key inside a layer
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.output_proj.weight": "self_attn.o_proj.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    "ln1.weight": "input_layernorm.weight",
    "ln2.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "token_embeddings.weight": "model.embed_tokens.weight",
    "ln_final.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_ROTATED = ("attn.q_proj.weight", "attn.k_proj.weight")


def _head_row_order(d_head: int, to_rotate_half: bool) -> Tensor:
    interleaved_to_half = torch.cat([torch.arange(0, d_head, 2), torch.arange(1, d_head, 2)])
    return interleaved_to_half if to_rotate_half else torch.argsort(interleaved_to_half)


def _permute_rows(weight: Tensor, config: ModelConfig, to_rotate_half: bool) -> Tensor:
    order = _head_row_order(config.d_head, to_rotate_half).to(weight.device)
    return weight.unflatten(0, (-1, config.d_head))[:, order].flatten(0, 1).contiguous()


def _convert(state_dict: dict[str, Tensor], config: ModelConfig, to_hf: bool) -> dict[str, Tensor]:
    # A tied head is saved once, as the embedding (HF checkpoints of tied models have no lm_head).
    out = {}
    for ours, hf in _pairs(config):
        source, target = (ours, hf) if to_hf else (hf, ours)
        weight = state_dict[source]
        # A model built with rope_layout="half" already pairs features as HF does: nothing to reorder.
        permute = ours.endswith(_ROTATED) and config.rope_layout == "interleaved"
        out[target] = _permute_rows(weight, config, to_hf) if permute else weight
    return out


def to_hf_llama_state_dict(state_dict: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """A tlm ``TransformerLM`` state dict as ``LlamaForCausalLM`` keys and row order."""
    return _convert(state_dict, config, to_hf=True)


def from_hf_llama_state_dict(state_dict: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """The inverse of :func:`to_hf_llama_state_dict`: load an HF Llama checkpoint into tlm."""
    return _convert(state_dict, config, to_hf=False)


def hf_llama_config_kwargs(config: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for ``transformers.LlamaConfig`` (transformers 5) describing ``config``."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.d_head,
        "max_position_embeddings": config.context_length,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta},
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
    }


# ---------------------------------------------------------------------------------------------
# HF folders

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

#: config.json keys that say nothing about the computation (token ids, bookkeeping, init).
_IGNORED = frozenset(
    {
        "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "bos_token_id",
        "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "_name_or_path", "output_attentions",
        "output_hidden_states", "return_dict", "tie_encoder_decoder", "is_decoder", "is_encoder_decoder",
    }
)  # fmt: skip
#: keys whose value must be the one tlm computes; anything else is refused.
_FIXED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "pretraining_tp": 1,
    "sliding_window": None,
}
_MAPPED = {
    "vocab_size": "vocab_size",
    "max_position_embeddings": "context_length",
    "hidden_size": "d_model",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "intermediate_size": "d_ff",
    "rms_norm_eps": "norm_eps",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "tie_word_embeddings": "tie_word_embeddings",
}
_SUPPORTED_ROPE_TYPES = ("default", *SCALINGS)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The :class:`ModelConfig` of an HF Llama ``config.json`` (as a dict); refuses, by key, any
    setting tlm does not compute (biases, sliding window, RoPE scaling, another activation...)."""
    if not isinstance(hf, dict):
        raise TypeError(f"hf must be a dict (a parsed config.json), got {type(hf).__name__}")
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"config.json: model_type must be 'llama', got {model_type!r}")
    if hf.get("architectures") not in (None, ["LlamaForCausalLM"]):
        raise ValueError(f"config.json: architectures must be ['LlamaForCausalLM'], got {hf['architectures']!r}")
    problems = []
    for key, value in _FIXED.items():
        if key in hf and hf[key] != value:
            problems.append(f"{key}={hf[key]!r} (tlm supports only {value!r})")
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta plus rope_scaling (type or rope_type).
    rope = hf.get("rope_parameters")
    if rope is None and hf.get("rope_scaling") is not None:
        rope = dict(hf["rope_scaling"])
        if "type" in rope:
            rope.setdefault("rope_type", rope.pop("type"))
    elif rope is not None and hf.get("rope_scaling") is not None:
        problems.append("both rope_parameters and rope_scaling are set")
    theta = hf.get("rope_theta")
    scaling = None
    if rope is not None:
        if not isinstance(rope, dict):
            problems.append(f"rope_parameters={rope!r} (expected a dict)")
        else:
            kind = rope.get("rope_type", "default")
            if kind not in _SUPPORTED_ROPE_TYPES:
                problems.append(f"rope_parameters.rope_type={kind!r} (supported: {_SUPPORTED_ROPE_TYPES})")
            elif kind == "default" and (extra := sorted(set(rope) - {"rope_type", "rope_theta"})):
                problems.append(f"rope_parameters keys {extra} with rope_type 'default'")
            elif kind != "default":
                scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
                scaling["rope_type"] = kind
                if kind == "dynamic":  # HF's dynamic NTK grows past max_position_embeddings
                    scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
            if theta is not None and rope.get("rope_theta", theta) != theta:
                problems.append(
                    f"rope_theta={theta!r} disagrees with rope_parameters.rope_theta={rope['rope_theta']!r}"
                )
            theta = rope.get("rope_theta", theta)
    known = _IGNORED | set(_FIXED) | set(_MAPPED) | {"rope_parameters", "rope_theta", "rope_scaling"}
    if unknown := sorted(set(hf) - known):
        problems.append(f"unknown keys {unknown}")
    if problems:
        raise ValueError("config.json has settings tlm cannot compute: " + "; ".join(problems))
    missing = sorted(k for k in ("vocab_size", "max_position_embeddings", "hidden_size", "num_hidden_layers",
                                 "num_attention_heads", "intermediate_size") if k not in hf)  # fmt: skip
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    fields = {ours: hf[key] for key, ours in _MAPPED.items() if key in hf and hf[key] is not None}
    fields.setdefault("norm_eps", 1e-6)  # LlamaConfig's default
    if theta is not None:
        fields["rope_theta"] = theta
    if scaling is not None:
        fields["rope_scaling"] = scaling
    # tlm stores the defaults as None, so a config that spells them out still equals the course's.
    if fields.get("num_kv_heads") == fields["num_heads"]:
        fields.pop("num_kv_heads")
    if (
        fields.get("head_dim") == fields["d_model"] // fields["num_heads"]
        and fields["d_model"] % fields["num_heads"] == 0
    ):
        fields.pop("head_dim")
    fields.setdefault("tie_word_embeddings", True)  # LlamaConfig's default (PretrainedConfig ties)
    return ModelConfig(**fields)


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    with open(path, "rb") as f:
        _, entries, _ = _ckpt._read_header(f, path)
        return _ckpt._read_tensors(f, entries)


def read_hf_state_dict(directory: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every tensor of an HF folder: ``model.safetensors``, or the shards its index names."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        state: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors = _read_safetensors(directory / shard)
            if stray := sorted(k for k in tensors if weight_map.get(k) != shard):
                raise ValueError(f"{directory / shard} holds tensors its index does not place there: {stray}")
            state.update(tensors)
        if absent := sorted(set(weight_map) - set(state)):
            raise ValueError(f"{index} names tensors no shard holds: {absent}")
        return state
    if (directory / WEIGHTS_NAME).is_file():
        return _read_safetensors(directory / WEIGHTS_NAME)
    raise FileNotFoundError(f"{directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def from_hf(
    directory: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    rope_layout: str = "interleaved",
    **options: Any,
) -> TransformerLM:
    """A :class:`TransformerLM` from an HF Llama folder (``config.json`` + safetensors, sharded or not).

    ``rope_layout="interleaved"`` (the default) reorders each head's q/k rows into tlm's pairing;
    ``"half"`` keeps HF's rows and rotates rotate-half pairs. ``dtype`` defaults to the dtype the
    weights are stored in; ``options`` (``fused=``,
    ``attention_backend=``) go to :class:`TransformerLM`. Tensors tlm would not use
    (biases, extra buffers) are refused by name.
    """
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist: not an HF model folder")
    try:
        hf = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path} is not valid JSON ({err})") from None
    config = dataclasses.replace(config_from_hf(hf), rope_layout=rope_layout)
    state = read_hf_state_dict(directory)
    if config.tie_word_embeddings and "lm_head.weight" in state:
        if not torch.equal(state["lm_head.weight"], state.get("model.embed_tokens.weight", state["lm_head.weight"])):
            raise ValueError(
                f"{directory}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
            )
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    names = {hf_key for _, hf_key in _pairs(config)}
    if unused := sorted(set(state) - names):
        raise ValueError(f"{directory}: tlm has no place for tensors {unused}")
    if missing := sorted(names - set(state)):
        raise ValueError(f"{directory}: missing tensors {missing}")
    dtypes = {t.dtype for t in state.values()}
    if dtype is None:
        if len(dtypes) != 1:
            raise ValueError(f"{directory} mixes dtypes {sorted(map(str, dtypes))}; pass dtype=")
        dtype = dtypes.pop()
    model = TransformerLM(config, device=device, dtype=dtype, **options)
    model.load_state_dict(from_hf_llama_state_dict(state, config), strict=True)
    return model


def _pairs(config: ModelConfig) -> list[tuple[str, str]]:
    pairs = [(ours, hf) for ours, hf in _TOP.items() if not (config.tie_word_embeddings and ours == "lm_head.weight")]
    return pairs + [
        (f"layers.{i}.{ours}", f"model.layers.{i}.{hf}")
        for i in range(config.num_layers)
        for ours, hf in _BLOCK.items()
    ]


def save_hf(model: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write ``model`` as an HF Llama folder (``config.json`` + ``model.safetensors``) that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads with the same logits.

    Each file is written all-or-nothing (a fresh temporary name beside it, fsync, one rename).
    """
    inner = unwrap(model)
    if not isinstance(inner, TransformerLM):
        raise TypeError(f"model must be a TransformerLM (or a compiled one), got {type(model).__name__}")
    config = inner.config
    tensors = _ckpt._cpu_tensors(to_hf_llama_state_dict(inner.state_dict(), config))
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **hf_llama_config_kwargs(config),
        "dtype": dtypes.pop() if len(dtypes) == 1 else "float32",
    }
    header = _ckpt._header(tensors, {"format": "pt"})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    chunks = [struct.pack("<Q", len(blob)) + blob] + [_ckpt._bytes(tensors[name]) for name in _ckpt._order(tensors)]
    _write_atomically(directory / WEIGHTS_NAME, chunks)
    _write_atomically(directory / CONFIG_NAME, [json.dumps(hf, indent=2, sort_keys=True).encode() + b"\n"])
    return directory


def _write_atomically(target: Path, chunks: list[Any]) -> None:
    tmp = _ckpt._create_temp(target.parent)
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _ckpt._fsync_folder(target.parent)
