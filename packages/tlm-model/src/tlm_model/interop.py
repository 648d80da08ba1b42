"""Convert between tlm's ``TransformerLM`` and HF transformers' ``LlamaForCausalLM`` (and read
``MistralForCausalLM`` within its sliding window, and ``Qwen2ForCausalLM``, whose q/k/v biases are
``ModelConfig.qkv_bias``: such a model is written back as a Qwen2).

The architectures are the same except for RoPE's pairing: tlm rotates interleaved pairs
(x[2k], x[2k+1]) as in the RoPE paper and Meta's LLaMA code, HF rotates (x[k], x[k + d/2])
("rotate-half"). Reordering the rows of each head's q and k projections maps one onto the other;
q·k is unchanged because both move together. Nothing here imports transformers: the HF folder
(``config.json`` + ``model.safetensors`` or a sharded ``model.safetensors.index.json``) is read and
written with the safetensors library (``tlm_model._weights``), and anything tlm cannot represent is
refused by name, never dropped.

A folder is read as untrusted input: every file is confined to it (``tlm_model._folder``), every
config value is type- and range-checked by its HF key, and the tensor table (names, shapes, dtypes)
is checked against the config before a byte of weights is allocated. An export replaces the folder
as one unit (``tlm_core.atomic.replace_dir``), so a kill or a concurrent reader sees the old export or
the new one, never new weights beside an old config or stale shards beside new weights.
"""

import contextlib
import dataclasses
import errno
import json
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tlm_core.atomic import create_new, remove_leftovers, replace_dir
from tlm_core.checks import check_bool, check_int, check_number, short_repr
from tlm_model import _folder, _weights
from tlm_model.config import LIMITS, ModelConfig
from tlm_model.inference import unwrap
from tlm_model.lm import TransformerLM
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
#: With ``qkv_bias`` (Qwen2): the biases of q, k and v, which follow their projections' rows.
_BIASES = {
    "attn.q_proj.bias": "self_attn.q_proj.bias",
    "attn.k_proj.bias": "self_attn.k_proj.bias",
    "attn.v_proj.bias": "self_attn.v_proj.bias",
}
_ROTATED = ("attn.q_proj.weight", "attn.k_proj.weight", "attn.q_proj.bias", "attn.k_proj.bias")


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


#: PEFT's prefix before an HF model's own parameter names (``PeftModel`` wraps a ``LoraModel`` wrapping the model).
PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"(.+)\.(lora_[AB])\.weight")


def to_hf_lora_state_dict(adapters: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """LoRA adapters keyed as ``tlm_lora.lora_state_dict`` keys them (``layers.0.attn.q_proj.lora_A.weight``)
    as a PEFT ``adapter_model.safetensors`` keys them for ``LlamaForCausalLM``
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). ``B``'s rows of q and k follow the
    weights' row order (HF's rotate-half RoPE pairs); ``A`` reads the input and keeps its columns."""
    check_llama_exportable(config)
    names = dict(_pairs(config))
    out = {}
    for key, tensor in adapters.items():
        match = _LORA_KEY.fullmatch(key)
        weight = None if match is None else match.group(1) + ".weight"
        if match is None or weight not in names:
            raise ValueError(f"{key!r} is not the key of a LoRA adapter on a projection of this model")
        hf = names[weight].removesuffix(".weight")
        permute = match.group(2) == "lora_B" and weight.endswith(_ROTATED) and config.rope_layout == "interleaved"
        out[f"{PEFT_PREFIX}{hf}.{match.group(2)}.weight"] = (
            _permute_rows(tensor, config, to_rotate_half=True) if permute else tensor.contiguous()
        )
    return out


def from_hf_lora_state_dict(adapters: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """The inverse of :func:`to_hf_lora_state_dict`: a PEFT adapter of a ``LlamaForCausalLM`` in tlm's keys
    and row order. A key on a module tlm does not have (a bias, an embedding adapter) is refused by name."""
    ours = {hf: mine for mine, hf in _pairs(config)}
    out = {}
    for key, tensor in adapters.items():
        match = _LORA_KEY.fullmatch(key.removeprefix(PEFT_PREFIX))
        weight = None if match is None else ours.get(match.group(1) + ".weight")
        if match is None or weight is None or not key.startswith(PEFT_PREFIX):
            raise ValueError(
                f"{key!r} is not a LoRA adapter tlm can load (only lora_A/lora_B on the Llama projections)"
            )
        permute = match.group(2) == "lora_B" and weight.endswith(_ROTATED) and config.rope_layout == "interleaved"
        target = f"{weight.removesuffix('.weight')}.{match.group(2)}.weight"
        out[target] = _permute_rows(tensor, config, to_rotate_half=False) if permute else tensor
    return out


#: The ModelConfig fields a Llama fixes, with the one value it can express and why.
_LLAMA_ONLY = {
    "norm_placement": ("pre", "LlamaForCausalLM normalises each sublayer's input"),
    "positions": ("rope", "LlamaForCausalLM always rotates q and k"),
    "ffn": ("swiglu", "LlamaForCausalLM's MLP is SwiGLU"),
}


def check_llama_exportable(config: ModelConfig) -> None:
    """Refuse, in one line naming the field, a config (an ablation) that an HF Llama config cannot express."""
    problems = [
        f"ModelConfig.{field}={getattr(config, field)!r} ({why}; only {field}={llama!r} exports)"
        for field, (llama, why) in _LLAMA_ONLY.items()
        if getattr(config, field) != llama
    ]
    if problems:
        raise ValueError("an HF Llama cannot express " + "; ".join(problems))


def to_hf_llama_state_dict(state_dict: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """A tlm ``TransformerLM`` state dict as ``LlamaForCausalLM`` keys and row order; a config that a
    Llama cannot express (:func:`check_llama_exportable`) is refused."""
    check_llama_exportable(config)
    return _convert(state_dict, config, to_hf=True)


def from_hf_llama_state_dict(state_dict: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """The inverse of :func:`to_hf_llama_state_dict`: load an HF Llama checkpoint into tlm."""
    return _convert(state_dict, config, to_hf=False)


def hf_llama_config_kwargs(config: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for ``transformers.LlamaConfig`` (transformers 5) describing ``config``; a config
    with ``qkv_bias`` is no Llama (a Llama's ``attention_bias`` puts a bias on the output projection too):
    :func:`hf_qwen2_config_kwargs` describes it."""
    if config.qkv_bias:
        raise ValueError(
            "an HF Llama cannot express ModelConfig.qkv_bias=True (its attention_bias adds one to o_proj too); it "
            "exports as Qwen2 (hf_qwen2_config_kwargs)"
        )
    return {**_shared_config_kwargs(config), "attention_bias": False, "mlp_bias": False}


def hf_qwen2_config_kwargs(config: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for ``transformers.Qwen2Config`` describing ``config``, which must have ``qkv_bias``
    (Qwen2's attention always has q/k/v biases) and attends over its whole context (no sliding window)."""
    if not config.qkv_bias:
        raise ValueError("a Qwen2 always has q/k/v biases: ModelConfig.qkv_bias must be True to export as Qwen2")
    return {**_shared_config_kwargs(config), "use_sliding_window": False, "sliding_window": None}


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``config``'s HF export: a ``LlamaForCausalLM``, or a ``Qwen2ForCausalLM``
    with ``qkv_bias``."""
    if config.qkv_bias:
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **hf_qwen2_config_kwargs(config)}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **hf_llama_config_kwargs(config)}


def _shared_config_kwargs(config: ModelConfig) -> dict[str, Any]:
    check_llama_exportable(config)
    context = config.context_length
    if config.rope_scaling is not None and config.rope_scaling["rope_type"] == "dynamic":
        # HF's dynamic NTK takes max_position_embeddings as the original context and grows past it by itself.
        context = config.rope_scaling["original_max_position_embeddings"]
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.d_head,
        "max_position_embeddings": context,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta},
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_word_embeddings,
    }


# ---------------------------------------------------------------------------------------------
# HF folders

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
GENERATION_CONFIG_NAME = "generation_config.json"

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
#: integer keys -> (ModelConfig field, whether null means "the default")
_INTS = {
    "vocab_size": ("vocab_size", False),
    "max_position_embeddings": ("context_length", False),
    "hidden_size": ("d_model", False),
    "num_hidden_layers": ("num_layers", False),
    "num_attention_heads": ("num_heads", False),
    "intermediate_size": ("d_ff", False),
    "num_key_value_heads": ("num_kv_heads", True),
    "head_dim": ("head_dim", True),
}
_OTHER_KEYS = frozenset({"rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling"})
#: The HF families tlm reads: model_type -> (architecture, the fixed keys its config.json may hold, the keys of its
#: sliding window). Mistral is a Llama whose attention may slide; Qwen2 adds biases to q, k and v (always) and
#: may slide in its upper layers. Within its window a sliding attention is tlm's full causal attention.
_FAMILIES: dict[str, tuple[str, frozenset[str], frozenset[str]]] = {
    "llama": ("LlamaForCausalLM", frozenset(_FIXED), frozenset()),
    "mistral": ("MistralForCausalLM", frozenset(_FIXED) - {"sliding_window"}, frozenset({"sliding_window"})),
    "qwen2": (
        "Qwen2ForCausalLM",
        frozenset({"hidden_act", "attention_dropout"}),
        frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}),
    ),
}
_LAYER_TYPES = ("full_attention", "sliding_attention")
_SUPPORTED_ROPE_TYPES = ("default", *SCALINGS)

#: Test seam: called with the name of each step of save_hf's folder build as it completes (tests kill
#: the process there): "weights-written", "config-written", "extra-written" (after each extra file).
#: tlm_core.atomic.after_step reports the steps of the swap itself.
_after_step: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if _after_step is not None:
        _after_step(name)


def config_from_hf(hf: dict[str, Any], *, source: str = CONFIG_NAME, context_length: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of an HF ``config.json`` (as a dict) of a Llama, a Mistral or a Qwen2
    (``model_type``); refuses, by key, any setting tlm does not compute (biases other than Qwen2's on q/k/v,
    another activation...) and any value of the wrong type or out of range (``null`` heads, a float context
    length, 100,000 layers), before anything is built. ``source`` starts each error message (the file's path).

    ``context_length`` (default ``max_position_embeddings``) imports the model for a shorter context (or, with
    ``dynamic`` RoPE scaling, which grows past ``max_position_embeddings`` by itself, a longer one). A
    sliding window (Mistral's ``sliding_window``; Qwen2's with ``use_sliding_window``) is accepted when the
    context fits inside it, where sliding-window attention is full causal attention; a longer context is
    refused in one line that says what fits."""
    if not isinstance(hf, dict):
        raise TypeError(f"hf must be a dict (a parsed config.json), got {type(hf).__name__}")
    model_type = hf.get("model_type", "llama")
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        raise ValueError(f"{source}: model_type must be one of {sorted(_FAMILIES)}, got {short_repr(model_type)}")
    architecture, fixed, window_keys = _FAMILIES[model_type]
    if hf.get("architectures") not in (None, [architecture]):
        raise ValueError(f"{source}: architectures must be [{architecture!r}], got {short_repr(hf['architectures'])}")
    problems = []
    for key in sorted(fixed):
        if key in hf and hf[key] != _FIXED[key]:
            problems.append(f"{key}={short_repr(hf[key])} (tlm supports only {_FIXED[key]!r})")
    rope, rope_problems = _rope_parameters(hf)
    problems += rope_problems
    if unknown := sorted(set(hf) - _IGNORED - fixed - window_keys - set(_INTS) - _OTHER_KEYS):
        problems.append(f"unknown keys {_weights.names(unknown)}")
    if problems:
        raise ValueError(f"{source} has settings tlm cannot compute: " + "; ".join(problems))
    required = [key for key, (_, nullable) in _INTS.items() if not nullable]
    if missing := [key for key in required if key not in hf]:
        raise ValueError(f"{source} lacks {missing}")
    # Every value by its HF key, before any arithmetic on it (a null or zero head count must not
    # reach a division) and before anything of the size it claims is built.
    fields: dict[str, Any] = {}
    for key, (field, nullable) in _INTS.items():
        if key in hf and not (nullable and hf[key] is None):
            fields[field] = check_int(f"{source}: {key}", hf[key], low=1, high=LIMITS[field])
    window = _sliding_window(hf, model_type, fields["num_layers"], source)
    fields["norm_eps"] = check_number(f"{source}: rms_norm_eps", hf.get("rms_norm_eps", 1e-6), low=0.0)  # HF's default
    # transformers' LlamaConfig defaults to an untied head (tie_word_embeddings: bool = False).
    fields["tie_word_embeddings"] = check_bool(f"{source}: tie_word_embeddings", hf.get("tie_word_embeddings", False))
    fields["qkv_bias"] = model_type == "qwen2"
    fields.update(_rope_fields(hf, rope, fields["context_length"], source))
    if context_length is not None:
        trained = fields["context_length"]
        fields["context_length"] = check_int("context_length", context_length, low=1)
        if context_length > trained and fields.get("rope_scaling", {}).get("rope_type") != "dynamic":
            raise ValueError(
                f"context_length must be at most the checkpoint's max_position_embeddings={trained} (the context it "
                f"was trained for; extend it with tlm train --init-from --context-length), got {context_length}"
            )
    if window is not None and fields["context_length"] > window:
        raise ValueError(
            f"{source}: sliding_window={window} is shorter than the context of {fields['context_length']} tokens, "
            f"and tlm attends over the whole context (the same only within the window); import at most "
            f"{window} tokens of context (context_length={window}; tlm convert --from-hf DIR --context-length {window})"
        )
    # tlm stores the defaults as None, so a config that spells them out still equals the course's.
    if fields.get("num_kv_heads") == fields["num_heads"]:
        fields.pop("num_kv_heads")
    d_model, heads = fields["d_model"], fields["num_heads"]
    if fields.get("head_dim") == d_model // heads and d_model % heads == 0:
        fields.pop("head_dim")
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as err:
        raise _weights.one_line(err, source) from None


def _rope_fields(hf: dict[str, Any], rope: dict[str, Any], context_length: int, source: str) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` of an HF config whose RoPE settings are ``rope`` (from
    :func:`_rope_parameters`) and whose ``max_position_embeddings`` is ``context_length``."""
    fields: dict[str, Any] = {}
    theta = rope.pop("rope_theta", hf.get("rope_theta"))
    if theta is not None:
        fields["rope_theta"] = check_number(f"{source}: rope_theta", theta, low=0.0, low_open=True)
    kind = rope.pop("rope_type", "default")
    if kind != "default":
        if kind == "dynamic":  # HF's dynamic NTK grows past max_position_embeddings, its original context
            original = rope.setdefault("original_max_position_embeddings", context_length)
            if original != context_length:
                raise ValueError(
                    f"{source}: rope_parameters.original_max_position_embeddings={short_repr(original)} differs from "
                    f"max_position_embeddings={context_length}, which transformers' dynamic rule takes as "
                    "the original context"
                )
        fields["rope_scaling"] = {"rope_type": kind, **_scaling_values(rope, kind, source)}
    return fields


def _sliding_window(hf: dict[str, Any], model_type: str, num_layers: int, source: str) -> int | None:
    """The window of the layers that slide (None: every layer attends over the whole context), as
    transformers' Mistral and Qwen2 read their configs."""
    if model_type == "llama":
        return None
    size = hf.get("sliding_window")
    if size is not None:
        size = check_int(f"{source}: sliding_window", size, low=1)
    if model_type == "mistral" or size is None:
        return size
    # Qwen2: no window unless use_sliding_window; then the layers layer_types names (default: those from
    # max_window_layers on) slide.
    if not check_bool(f"{source}: use_sliding_window", hf.get("use_sliding_window", False)):
        return None
    types = hf.get("layer_types")
    if types is None:
        first = check_int(f"{source}: max_window_layers", hf.get("max_window_layers", 28), low=0)
        return size if first < num_layers else None
    if not isinstance(types, list) or len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(
            f"{source}: layer_types must list one of {_LAYER_TYPES} for each of the {num_layers} layers, "
            f"got {short_repr(types)}"
        )
    return size if "sliding_attention" in types else None


def _rope_parameters(hf: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The RoPE settings as one dict (``rope_type``, ``rope_theta``, scaling keys), and what is wrong."""
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta plus rope_scaling (type or rope_type).
    rope, legacy = hf.get("rope_parameters"), hf.get("rope_scaling")
    if rope is not None and legacy is not None:
        return {}, ["both rope_parameters and rope_scaling are set"]
    key = "rope_parameters" if rope is not None else "rope_scaling"
    rope = rope if rope is not None else legacy
    if rope is None:
        return {}, []
    if not isinstance(rope, dict):
        return {}, [f"{key}={short_repr(rope)} (expected a dict)"]
    rope = dict(rope)
    if key == "rope_scaling" and "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    kind = rope.get("rope_type", "default")
    if not isinstance(kind, str) or kind not in _SUPPORTED_ROPE_TYPES:
        return {}, [f"{key}.rope_type={short_repr(kind)} (supported: {_SUPPORTED_ROPE_TYPES})"]
    if kind == "default" and (extra := sorted(set(rope) - {"rope_type", "rope_theta"})):
        return {}, [f"{key} keys {_weights.names(extra)} with rope_type 'default'"]
    theta = hf.get("rope_theta")
    if theta is not None and rope.get("rope_theta", theta) != theta:
        return {}, [f"rope_theta={short_repr(theta)} disagrees with {key}.rope_theta={short_repr(rope['rope_theta'])}"]
    return rope, []


def _scaling_values(rope: dict[str, Any], kind: str, source: str) -> dict[str, Any]:
    # The scaling's own keys by type (ModelConfig checks which keys a rope_type takes); a null or a
    # string here would otherwise surface as a TypeError deep inside the RoPE table's arithmetic.
    out = dict(rope)
    required, optional = SCALINGS[kind]
    for key in sorted((required | optional) & set(rope)):
        name = f"{source}: rope_parameters.{key}"
        if key == "original_max_position_embeddings":
            out[key] = check_int(name, rope[key], low=1, high=LIMITS["context_length"])
        elif key == "truncate":
            out[key] = check_bool(name, rope[key])
        else:
            check_number(name, rope[key])
    return out


def _expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor an HF folder of ``config`` holds, from ``config`` alone."""
    shapes = _weights.expected_shapes(config)
    return {hf: shapes[ours] for ours, hf in _pairs(config)}


def read_hf_state_dict(directory: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every tensor of the HF folder ``directory`` (``model.safetensors``, or the shards its index
    names), checked against its ``config.json`` first. See :func:`from_hf`."""
    return _folder.read_consistently(Path(directory), _read_folder)[1]


def from_hf(
    directory: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    rope_layout: str = "interleaved",
    context_length: int | None = None,
    **options: Any,
) -> TransformerLM:
    """A :class:`TransformerLM` from an HF Llama, Mistral or Qwen2 folder (``config.json`` + safetensors,
    sharded or not). ``context_length`` (default: the checkpoint's ``max_position_embeddings``) imports it
    for a shorter context, as a sliding window needs (see :func:`config_from_hf`).

    ``rope_layout="interleaved"`` (the default) reorders each head's q/k rows into tlm's pairing;
    ``"half"`` keeps HF's rows and rotates rotate-half pairs. ``dtype`` (a floating dtype) defaults to
    the dtype the weights are stored in; ``options`` (``fused=``, ``attention_backend=``) go to
    :class:`TransformerLM`.

    Like transformers, a folder with both ``model.safetensors`` and an index reads the single file.
    The folder is untrusted input: every file it names must lie inside it (a symlink may point into
    the HF hub cache's ``blobs`` folder of the same repository, nothing else); every config value is
    checked by its key; every tensor's name, shape and dtype is checked against the config before any
    weights are allocated (tensors tlm would not use, such as biases, are refused by name); every
    safetensors header is checked (offsets tile the data exactly); weights holding NaN or infinity are
    refused by name. Each error is one line naming the file. All files are read from one version of the
    folder, even while :func:`save_hf` replaces it.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {short_repr(dtype)}")
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"not an HF model folder (a folder with {CONFIG_NAME})", str(directory))
    config, state = _folder.read_consistently(
        directory, lambda folder: _read_folder(folder, rope_layout, context_length)
    )
    if config.tie_word_embeddings and "lm_head.weight" in state:
        if not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            raise ValueError(
                f"{directory}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
            )
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    dtypes = {t.dtype for t in state.values()}
    if dtype is None:
        if len(dtypes) != 1:
            raise ValueError(f"{directory} mixes dtypes {sorted(map(str, dtypes))}; pass dtype=")
        dtype = dtypes.pop()
    model = TransformerLM(config, device=device, dtype=dtype, **options)
    model.load_state_dict(from_hf_llama_state_dict(state, config), strict=True)
    return model


def _read_folder(
    folder: _folder.Folder, rope_layout: str = "interleaved", context_length: int | None = None
) -> tuple[ModelConfig, dict[str, Tensor]]:
    config_path = folder.path / CONFIG_NAME
    raw = folder.read(CONFIG_NAME, _weights.MAX_JSON_BYTES)
    if raw is None:
        raise FileNotFoundError(errno.ENOENT, f"not an HF model folder: it has no {CONFIG_NAME}", str(config_path))
    config = config_from_hf(
        _weights.parse_json_object(raw, config_path), source=str(config_path), context_length=context_length
    )
    config = dataclasses.replace(config, rope_layout=rope_layout)
    expected = _expected_tensors(config)
    with contextlib.ExitStack() as stack:
        shards = _open_weights(folder, expected, config, stack)
        table = {name: entry for file in shards for name, entry in file.table.items()}
        where = shards[0].path if len(shards) == 1 else folder.path
        if problems := _weights.table_problems(_with_tied_head(expected, config, table), table, CONFIG_NAME,
                                               unexpected="tlm has no place for tensors"):  # fmt: skip
            raise ValueError(f"{where} does not fit {config_path}: " + "; ".join(problems))
        state: dict[str, Tensor] = {}
        for file in shards:
            tensors = file.tensors()
            # A diverged fine-tune or a damaged export loads and generates without complaint elsewhere; here the
            # folder is untrusted input, and one pass over the weights names what is not a number.
            if bad := sorted(name for name, tensor in tensors.items() if not torch.isfinite(tensor).all()):
                more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
                raise ValueError(f"{file.path}: {', '.join(bad[:3])}{more} hold NaN or infinite values")
            state.update(tensors)
    return config, state


def _with_tied_head(
    expected: dict[str, tuple[int, ...]], config: ModelConfig, found: Mapping[str, object]
) -> dict[str, tuple[int, ...]]:
    # A tied checkpoint may spell the head out (equal to the embedding; from_hf checks that).
    if config.tie_word_embeddings and "lm_head.weight" in found:
        return {**expected, "lm_head.weight": expected["model.embed_tokens.weight"]}
    return expected


def _open_weights(
    folder: _folder.Folder, expected: dict[str, tuple[int, ...]], config: ModelConfig, stack: contextlib.ExitStack
) -> list[_weights.TensorFile]:
    """The single weights file, or each shard the index names, open (headers read, no tensor yet)."""

    def open_file(name: str, handle: Any) -> _weights.TensorFile:
        stack.enter_context(handle)
        return stack.enter_context(_weights.TensorFile(handle, folder.path / name))

    single = folder.open(WEIGHTS_NAME)
    if single is not None:  # transformers' precedence: the single file wins over an index beside it
        return [open_file(WEIGHTS_NAME, single)]
    index_path = folder.path / INDEX_NAME
    raw = folder.read(INDEX_NAME, _weights.MAX_JSON_BYTES)
    if raw is None:
        raise FileNotFoundError(
            errno.ENOENT, f"not an HF model folder: no {WEIGHTS_NAME} nor {INDEX_NAME}", str(folder.path)
        )
    weight_map = _weight_map(raw, index_path)
    # The index alone says which tensors the folder holds: a mismatch is refused before a shard is opened.
    names_only = dict.fromkeys(weight_map)
    if problems := _weights.table_problems(_with_tied_head(expected, config, names_only), names_only, CONFIG_NAME,
                                           unexpected="tlm has no place for tensors"):  # fmt: skip
        raise ValueError(f"{index_path} does not fit {folder.path / CONFIG_NAME}: " + "; ".join(problems))
    by_shard: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(name)
    shards = []
    for shard in sorted(by_shard):
        opened = folder.open(shard)
        if opened is None:
            raise FileNotFoundError(
                errno.ENOENT, f"{INDEX_NAME} names this shard; the folder lacks it", str(folder.path / shard)
            )
        file = open_file(shard, opened)
        if stray := sorted(set(file.table) - by_shard[shard]):
            raise ValueError(f"{file.path} holds tensors its index does not place there: {_weights.names(stray)}")
        if absent := sorted(by_shard[shard] - set(file.table)):
            raise ValueError(f"{index_path} places tensors in {shard} that it does not hold: {_weights.names(absent)}")
        shards.append(file)
    return shards


def _weight_map(raw: bytes, path: Path) -> dict[str, str]:
    weight_map = _weights.parse_json_object(raw, path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"{path}: weight_map must be a JSON object (tensor name -> shard file), got {type(weight_map).__name__}"
        )
    for name, shard in weight_map.items():
        _folder.check_name(shard, f"{path}: weight_map[{short_repr(name, 60)}]")
    return weight_map


def _pairs(config: ModelConfig) -> list[tuple[str, str]]:
    pairs = [(ours, hf) for ours, hf in _TOP.items() if not (config.tie_word_embeddings and ours == "lm_head.weight")]
    block = {**_BLOCK, **_BIASES} if config.qkv_bias else _BLOCK
    return pairs + [
        (f"layers.{i}.{ours}", f"model.layers.{i}.{hf}") for i in range(config.num_layers) for ours, hf in block.items()
    ]


# ---------------------------------------------------------------------------------------------
# Export

#: What an HF model export holds: transformers' save_pretrained (weights, index, shards, the config,
#: the generation config) and a tokenizer's save_pretrained. save_hf replaces a folder that holds only
#: these (and the extra_files it is given), so that it never wipes a user's unrelated files.
_EXPORT_NAMES = frozenset(
    {
        CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME, GENERATION_CONFIG_NAME, "pytorch_model.bin",
        "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    }
)  # fmt: skip
_EXPORT_PATTERN = re.compile(r"model-\d+-of-\d+\.safetensors|pytorch_model-\d+-of-\d+\.bin")
#: Files save_hf writes, or that transformers would read as weights: no extra file may take these names.
_RESERVED = frozenset({CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME, "pytorch_model.bin", "pytorch_model.bin.index.json"})
_RESERVED_PATTERN = re.compile(r"model-\d+-of-\d+\.safetensors|pytorch_model-\d+-of-\d+\.bin", re.IGNORECASE)
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def hf_generation_config(
    eos_token_id: int | Sequence[int], *, bos_token_id: int | None = None, pad_token_id: int | None = None
) -> dict[str, Any]:
    """The content of an HF ``generation_config.json`` for these token ids, as a dict that
    ``transformers.GenerationConfig`` reads. ``eos_token_id`` is one id or several (any of them ends
    generation). Give it to :func:`save_hf` as
    ``extra_files={"generation_config.json": json.dumps(payload).encode()}``."""
    if isinstance(eos_token_id, Sequence) and not isinstance(eos_token_id, (str, bytes)):
        if not eos_token_id:
            raise ValueError("eos_token_id must be a token id or a non-empty list of them, got []")
        eos: int | list[int] = [check_int(f"eos_token_id[{i}]", t, low=0) for i, t in enumerate(eos_token_id)]
    else:
        eos = check_int("eos_token_id", eos_token_id, low=0)
    payload: dict[str, Any] = {"eos_token_id": eos}
    if bos_token_id is not None:
        payload["bos_token_id"] = check_int("bos_token_id", bos_token_id, low=0)
    if pad_token_id is not None:
        payload["pad_token_id"] = check_int("pad_token_id", pad_token_id, low=0)
    return payload


def save_hf(
    model: nn.Module, directory: str | os.PathLike[str], *, extra_files: Mapping[str, bytes] | None = None
) -> Path:
    """Write ``model`` as an HF Llama folder (``config.json`` + ``model.safetensors``, plus
    ``extra_files``: name -> bytes, e.g. ``tokenizer.json``, ``tokenizer_config.json``,
    ``generation_config.json`` from :func:`hf_generation_config`) that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads with the same logits. Returns the folder.

    The folder is replaced as one unit (``tlm_core.atomic.replace_dir``): built complete under a
    temporary name beside it, then swapped in, so a kill at any moment, or a reader meanwhile, sees the
    previous export or this one, never a mix, and no file of an older export (an index, stale shards)
    survives. A folder that holds anything an HF model export would not (a user's own files, a
    subfolder, a symlink) is refused, not replaced; so is ``directory`` itself being a symlink.
    Extra file names must be plain names that do not clash with the files this writes or that HF reads
    as weights; a ``generation_config.json`` must hold token ids inside the model's vocabulary.
    Temporary folders that killed exports left beside ``directory`` are removed.
    """
    inner = unwrap(model)
    if not isinstance(inner, TransformerLM):
        raise TypeError(f"model must be a TransformerLM (or a compiled one), got {type(model).__name__}")
    config = inner.config
    extra = _check_extra_files(extra_files, config)
    tensors = _weights.cpu_tensors(to_hf_llama_state_dict(inner.state_dict(), config))
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    hf = {**hf_config(config), "dtype": dtypes.pop() if len(dtypes) == 1 else "float32"}
    weights = _weights.serialize(tensors, {"format": "pt"})
    config_json = json.dumps(hf, indent=2, sort_keys=True).encode() + b"\n"

    directory = Path(directory)
    _check_replaceable(directory, set(extra))
    remove_leftovers(directory.parent, directory.name)

    def fill(folder: Path) -> None:
        _write_new(folder / WEIGHTS_NAME, weights)
        _step("weights-written")
        _write_new(folder / CONFIG_NAME, config_json)
        _step("config-written")
        for name, data in extra.items():
            _write_new(folder / name, data)
            _step("extra-written")

    replace_dir(directory, fill)
    return directory


def _check_extra_files(extra_files: Mapping[str, bytes] | None, config: ModelConfig) -> dict[str, bytes]:
    if extra_files is None:
        return {}
    if not isinstance(extra_files, Mapping):
        raise TypeError(f"extra_files must be a mapping of file names to bytes, got {type(extra_files).__name__}")
    out = {}
    for name, data in extra_files.items():
        _folder.check_name(name, "extra_files key")
        if name.lower() in _RESERVED or _RESERVED_PATTERN.fullmatch(name):
            raise ValueError(
                f"extra_files key must not be a file save_hf writes or HF reads as weights, got {short_repr(name)}"
            )
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"extra_files[{short_repr(name)}] must be bytes, got {type(data).__name__} (encode text)")
        out[name] = bytes(data)
    if GENERATION_CONFIG_NAME in out:
        _check_generation_config(out[GENERATION_CONFIG_NAME], config.vocab_size)
    return out


def _check_generation_config(data: bytes, vocab_size: int) -> None:
    where = f"extra_files[{GENERATION_CONFIG_NAME!r}]"
    payload = _weights.parse_json_object(data, where)
    for key in _TOKEN_ID_KEYS:
        value = payload.get(key)
        for i, token in enumerate(value if isinstance(value, list) else [] if value is None else [value]):
            name = f"{where} {key}" + (f"[{i}]" if isinstance(value, list) else "")
            check_int(name, token, low=0, high=vocab_size - 1)


def _check_replaceable(directory: Path, extra_names: set[str]) -> None:
    here, target = Path(os.getcwd()), Path(os.path.realpath(directory))
    if target == here or target in here.parents:
        # The swap would leave this process inside the old folder, deleted right after.
        raise ValueError(f"directory must not be the current folder or one above it, got {directory}")
    try:
        mode = os.lstat(directory).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise ValueError(
            f"directory must be a folder, got a symlink ({directory}); save_hf replaces the folder itself "
            f"and never follows a link: give the folder it points to"
        )
    if not stat.S_ISDIR(mode):
        raise NotADirectoryError(errno.ENOTDIR, "directory must be a folder (or not exist), got a file", str(directory))
    with os.scandir(directory) as entries:
        foreign = sorted(
            entry.name
            for entry in entries
            if not entry.is_file(follow_symlinks=False)
            or not (entry.name in _EXPORT_NAMES or entry.name in extra_names or _EXPORT_PATTERN.fullmatch(entry.name))
        )
    if foreign:
        raise ValueError(
            f"directory {directory} holds {_weights.names(foreign)}, which an HF model export does not; save_hf "
            f"replaces the whole folder, so it leaves this one alone (save into a new or empty folder)"
        )


def _write_new(path: Path, data: bytes) -> None:
    # Inside the fresh temporary folder replace_dir made; it fsyncs the whole tree before the swap.
    with create_new(path) as f:  # O_EXCL | O_NOFOLLOW: nothing planted under the name is followed
        f.write(data)
