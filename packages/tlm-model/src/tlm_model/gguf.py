"""Write a :class:`~tlm_model.TransformerLM` as a GGUF file (llama.cpp's, ollama's and LM Studio's format)
through the ``gguf`` library (the ``gguf`` extra: ``pip install tlm-model[gguf]``).

The file holds llama.cpp's ``llama`` architecture (``qwen2`` for a model with ``qkv_bias``), its metadata under
llama.cpp's key names, the weights under llama.cpp's tensor names and, given a :class:`GGUFVocabulary`, the
byte-level BPE tokenizer (``tokenizer.ggml.model = "gpt2"``: tokens, token types, merges, end-of-text id, chat
template). llama.cpp's ``llama`` rotates interleaved pairs as tlm does, so q and k keep tlm's rows there; its
``qwen2`` rotates halves as HF does, so they take HF's. As llama.cpp's own converter does, the one-dimensional
tensors (norm weights, biases) stay float32 whatever ``dtype`` the matrices take. The file is written beside
its path and renamed over it when complete.

A model that a Llama (or Qwen2) cannot express is refused, as :func:`tlm_model.save_hf` refuses it, and so is a
RoPE scaling: transformers' GGUF reader drops llama.cpp's scaling keys, so such a file could not be checked.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor, nn

from tlm_core.atomic import atomic_path
from tlm_core.checks import check_choice, short_repr
from tlm_model.inference import unwrap
from tlm_model.interop import _permute_rows, check_llama_exportable, to_hf_llama_state_dict
from tlm_model.lm import TransformerLM

__all__ = ["GGUF_DTYPES", "GGUFVocabulary", "save_gguf"]

#: The dtypes the matrices can take (the one-dimensional tensors stay float32).
GGUF_DTYPES = ("float32", "float16", "bfloat16")

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}  # fmt: skip
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


@dataclass(frozen=True)
class GGUFVocabulary:
    """A byte-level BPE tokenizer as GGUF holds it: ``tokens[i]`` is token ``i``'s text in GPT-2's byte-level
    alphabet (a special token as its own text), ``merges`` are ``"left right"`` pairs in rank order,
    ``special`` the ids of control tokens (``<|endoftext|>``, a chat template's markers), ``eos_token_id`` the
    end of a sequence, ``chat_template`` the Jinja template ``apply_chat_template`` renders."""

    tokens: Sequence[str]
    merges: Sequence[str]
    special: frozenset[int] = field(default_factory=frozenset)
    eos_token_id: int | None = None
    chat_template: str | None = None


def save_gguf(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    vocabulary: GGUFVocabulary | None = None,
    name: str = "tlm",
) -> Path:
    """Write ``model`` (a :class:`TransformerLM`, or a compiled one) to the GGUF file ``path``, its matrices
    in ``dtype`` (one of :data:`GGUF_DTYPES`), with ``vocabulary``'s tokenizer when given (its tokens are
    padded with unused ``[PADi]`` entries up to the model's vocabulary). Returns the path."""
    inner = unwrap(model)
    if not isinstance(inner, TransformerLM):
        raise TypeError(f"model must be a TransformerLM (or a compiled one), got {type(model).__name__}")
    check_choice("dtype", dtype, GGUF_DTYPES)
    config = inner.config
    check_llama_exportable(config)
    if config.rope_scaling is not None:
        raise ValueError(
            f"a GGUF export of a RoPE-scaled model (rope_scaling={config.rope_scaling}) is not supported: "
            "transformers' GGUF reader drops the scaling, so the file could not be verified; export to HF instead"
        )
    if vocabulary is not None and not isinstance(vocabulary, GGUFVocabulary):
        raise TypeError(f"vocabulary must be a GGUFVocabulary or None, got {type(vocabulary).__name__}")
    arch = "qwen2" if config.qkv_bias else "llama"
    hf = to_hf_llama_state_dict(inner.state_dict(), config)
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"path must be a file to write, got the folder {path}")
    with atomic_path(path) as tmp:  # tlm_core.atomic: all-or-nothing, a symlink at path replaced, not followed
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            writer.add_name(name)
            writer.add_file_type(
                {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                 "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]
            )  # fmt: skip
            writer.add_vocab_size(config.vocab_size)
            writer.add_context_length(config.context_length)
            writer.add_embedding_length(config.d_model)
            writer.add_block_count(config.num_layers)
            writer.add_feed_forward_length(config.d_ff)
            writer.add_head_count(config.num_heads)
            writer.add_head_count_kv(config.kv_heads)
            writer.add_key_length(config.d_head)
            writer.add_value_length(config.d_head)
            writer.add_rope_dimension_count(config.d_head)
            writer.add_rope_freq_base(config.rope_theta)
            writer.add_layer_norm_rms_eps(config.norm_eps)
            if vocabulary is not None:
                _add_vocabulary(writer, vocabulary, config.vocab_size)
            for hf_name, tensor in hf.items():
                if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                    # llama.cpp's llama rotates interleaved pairs: HF's rotate-half rows back to them.
                    tensor = _permute_rows(tensor, config, to_rotate_half=False)
                array, raw_dtype = _array(tensor, dtype)
                writer.add_tensor(_name(hf_name), array, raw_dtype=raw_dtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return path


def _name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{_LAYER[rest]}"


def _array(tensor: Tensor, dtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """The array and raw dtype ``GGUFWriter.add_tensor`` takes for ``tensor`` in ``dtype``."""
    tensor = tensor.detach().cpu()
    if tensor.ndim < 2 or dtype == "float32":
        return tensor.to(torch.float32).contiguous().numpy(), None
    if dtype == "float16":
        return tensor.to(torch.float16).contiguous().numpy(), None
    # numpy has no bfloat16: its bits as uint16, typed by the raw dtype.
    return tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(
        np.uint16
    ), gguf.GGMLQuantizationType.BF16


def _add_vocabulary(writer: gguf.GGUFWriter, vocabulary: GGUFVocabulary, vocab_size: int) -> None:
    tokens = list(vocabulary.tokens)
    if len(tokens) > vocab_size:
        raise ValueError(
            f"vocabulary has {len(tokens)} tokens, more than the model's vocab_size={vocab_size} ids it embeds"
        )
    types = gguf.TokenType
    kinds = [types.CONTROL if i in vocabulary.special else types.NORMAL for i in range(len(tokens))]
    # An id the tokenizer never produces (an HF model's vocabulary may be larger): llama.cpp's placeholder.
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        kinds.append(types.UNUSED)
    for i, merge in enumerate(vocabulary.merges):
        if not isinstance(merge, str) or merge.count(" ") != 1:
            raise ValueError(f"vocabulary.merges[{i}] must be a 'left right' string, got {short_repr(merge)}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([int(kind) for kind in kinds])
    writer.add_token_merges(list(vocabulary.merges))
    writer.add_add_bos_token(False)
    if vocabulary.eos_token_id is not None:
        if not 0 <= vocabulary.eos_token_id < len(vocabulary.tokens):
            raise ValueError(f"vocabulary.eos_token_id must be a token id, got {vocabulary.eos_token_id}")
        writer.add_eos_token_id(vocabulary.eos_token_id)
    if vocabulary.chat_template is not None:
        writer.add_chat_template(vocabulary.chat_template)
