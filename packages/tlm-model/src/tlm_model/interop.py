"""Convert state dicts between tlm's layout and HF transformers' ``LlamaForCausalLM``.

The architectures are the same except for RoPE's pairing: tlm rotates interleaved pairs
(x[2k], x[2k+1]) as in the RoPE paper and Meta's LLaMA code, HF rotates (x[k], x[k + d/2])
("rotate-half"). Reordering the rows of each head's q and k projections maps one onto the other;
q·k is unchanged because both move together. Nothing here imports transformers.
"""

from typing import Any

import torch
from torch import Tensor

from tlm_model.config import ModelConfig

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
    return weight.unflatten(0, (config.num_heads, config.d_head))[:, order].flatten(0, 1).contiguous()


def _convert(state_dict: dict[str, Tensor], config: ModelConfig, to_hf: bool) -> dict[str, Tensor]:
    pairs = [(ours, hf) for ours, hf in _TOP.items()]
    pairs += [
        (f"layers.{i}.{ours}", f"model.layers.{i}.{hf}")
        for i in range(config.num_layers)
        for ours, hf in _BLOCK.items()
    ]
    out = {}
    for ours, hf in pairs:
        source, target = (ours, hf) if to_hf else (hf, ours)
        weight = state_dict[source]
        out[target] = _permute_rows(weight, config, to_hf) if ours.endswith(_ROTATED) else weight
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
        "num_key_value_heads": config.num_heads,
        "max_position_embeddings": config.context_length,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
