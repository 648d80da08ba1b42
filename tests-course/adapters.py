"""Drop-in replacement for the course's ``tests/adapters.py`` (CS336 spring 2025, assignment 1).

Each ``run_*`` builds the matching tlm module from scratch, loads the given weights with
``load_state_dict`` and runs it, so the course's tests exercise tlm's own code paths, never a
torch built-in: attention uses the ``"reference"`` backend and projections are not fused.

The training parts (batches, loss, clipping, AdamW, the schedule, checkpoints) come from
tlm-train, tlm-optim and tlm-model's ``cross_entropy``; the tokenizer and BPE training from
tlm-tokenizer. Every adapter of the course's suite is implemented.
"""

import os
from collections.abc import Iterable
from typing import IO, Any, BinaryIO

import numpy.typing as npt
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tlm_attention import CausalMultiHeadSelfAttention, scaled_dot_product_attention, softmax
from tlm_ffn import SwiGLU, silu
from tlm_linear import Embedding, Linear
from tlm_model import ModelConfig, TransformerBlock, TransformerLM, cross_entropy
from tlm_norm import RMSNorm
from tlm_optim import AdamW, clip_grad_norm_, cosine_lr
from tlm_rope import RotaryPositionalEmbedding
from tlm_tokenizer import Tokenizer, train_bpe
from tlm_train import get_batch, load_checkpoint, save_checkpoint


def _placed(weight: Tensor) -> dict[str, Any]:
    return {"device": weight.device, "dtype": weight.dtype}


def run_linear(
    d_in: int,
    d_out: int,
    weights: Float[Tensor, " d_out d_in"],
    in_features: Float[Tensor, " ... d_in"],
) -> Float[Tensor, " ... d_out"]:
    layer = Linear(d_in, d_out, **_placed(weights))
    layer.load_state_dict({"weight": weights})
    return layer(in_features)


def run_embedding(
    vocab_size: int,
    d_model: int,
    weights: Float[Tensor, " vocab_size d_model"],
    token_ids: Int[Tensor, " ..."],
) -> Float[Tensor, " ... d_model"]:
    layer = Embedding(vocab_size, d_model, **_placed(weights))
    layer.load_state_dict({"weight": weights})
    return layer(token_ids)


def run_swiglu(
    d_model: int,
    d_ff: int,
    w1_weight: Float[Tensor, " d_ff d_model"],
    w2_weight: Float[Tensor, " d_model d_ff"],
    w3_weight: Float[Tensor, " d_ff d_model"],
    in_features: Float[Tensor, " ... d_model"],
) -> Float[Tensor, " ... d_model"]:
    ffn = SwiGLU(d_model, d_ff, fused=False, **_placed(w1_weight))
    ffn.load_state_dict({"w1.weight": w1_weight, "w2.weight": w2_weight, "w3.weight": w3_weight})
    return ffn(in_features)


def run_scaled_dot_product_attention(
    Q: Float[Tensor, " ... queries d_k"],
    K: Float[Tensor, " ... keys d_k"],
    V: Float[Tensor, " ... keys d_v"],
    mask: Bool[Tensor, " ... queries keys"] | None = None,
) -> Float[Tensor, " ... queries d_v"]:
    return scaled_dot_product_attention(Q, K, V, mask)


def _attention_weights(q: Tensor, k: Tensor, v: Tensor, o: Tensor) -> dict[str, Tensor]:
    return {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "output_proj.weight": o}


def run_multihead_self_attention(
    d_model: int,
    num_heads: int,
    q_proj_weight: Float[Tensor, " d_k d_in"],
    k_proj_weight: Float[Tensor, " d_k d_in"],
    v_proj_weight: Float[Tensor, " d_v d_in"],
    o_proj_weight: Float[Tensor, " d_model d_v"],
    in_features: Float[Tensor, " ... sequence_length d_in"],
) -> Float[Tensor, " ... sequence_length d_out"]:
    attn = CausalMultiHeadSelfAttention(
        d_model, num_heads, attention_backend="reference", fused=False, **_placed(q_proj_weight)
    )
    attn.load_state_dict(_attention_weights(q_proj_weight, k_proj_weight, v_proj_weight, o_proj_weight))
    return attn(in_features)


def run_multihead_self_attention_with_rope(
    d_model: int,
    num_heads: int,
    max_seq_len: int,
    theta: float,
    q_proj_weight: Float[Tensor, " d_k d_in"],
    k_proj_weight: Float[Tensor, " d_k d_in"],
    v_proj_weight: Float[Tensor, " d_v d_in"],
    o_proj_weight: Float[Tensor, " d_model d_v"],
    in_features: Float[Tensor, " ... sequence_length d_in"],
    token_positions: Int[Tensor, " ... sequence_length"] | None = None,
) -> Float[Tensor, " ... sequence_length d_out"]:
    rope = RotaryPositionalEmbedding(theta, d_model // num_heads, max_seq_len, device=q_proj_weight.device)
    attn = CausalMultiHeadSelfAttention(
        d_model, num_heads, rope=rope, attention_backend="reference", fused=False, **_placed(q_proj_weight)
    )
    attn.load_state_dict(_attention_weights(q_proj_weight, k_proj_weight, v_proj_weight, o_proj_weight))
    return attn(in_features, token_positions)


def run_rope(
    d_k: int,
    theta: float,
    max_seq_len: int,
    in_query_or_key: Float[Tensor, " ... sequence_length d_k"],
    token_positions: Int[Tensor, " ... sequence_length"],
) -> Float[Tensor, " ... sequence_length d_k"]:
    rope = RotaryPositionalEmbedding(theta, d_k, max_seq_len, device=in_query_or_key.device)
    return rope(in_query_or_key, token_positions)


def run_transformer_block(
    d_model: int,
    num_heads: int,
    d_ff: int,
    max_seq_len: int,
    theta: float,
    weights: dict[str, Tensor],
    in_features: Float[Tensor, " batch sequence_length d_model"],
) -> Float[Tensor, " batch sequence_length d_model"]:
    # The block reads its sizes from a ModelConfig; the vocabulary and depth do not matter to one block.
    config = ModelConfig(
        vocab_size=1, context_length=max_seq_len, d_model=d_model, num_layers=1, num_heads=num_heads, d_ff=d_ff,
        rope_theta=theta,
    )  # fmt: skip
    block = TransformerBlock(config, attention_backend="reference", fused=False, **_placed(weights["ln1.weight"]))
    block.load_state_dict(weights)
    return block(in_features)


def run_transformer_lm(
    vocab_size: int,
    context_length: int,
    d_model: int,
    num_layers: int,
    num_heads: int,
    d_ff: int,
    rope_theta: float,
    weights: dict[str, Tensor],
    in_indices: Int[Tensor, " batch_size sequence_length"],
) -> Float[Tensor, " batch_size sequence_length vocab_size"]:
    placed = _placed(weights["ln_final.weight"] if "ln_final.weight" in weights else next(iter(weights.values())))
    config = ModelConfig(vocab_size, context_length, d_model, num_layers, num_heads, d_ff, rope_theta)
    model = TransformerLM(config, attention_backend="reference", fused=False, **placed)
    model.load_state_dict(weights)
    return model(in_indices)


def run_rmsnorm(
    d_model: int,
    eps: float,
    weights: Float[Tensor, " d_model"],
    in_features: Float[Tensor, " ... d_model"],
) -> Float[Tensor, " ... d_model"]:
    norm = RMSNorm(d_model, eps=eps, **_placed(weights))
    norm.load_state_dict({"weight": weights})
    return norm(in_features)


def run_silu(in_features: Float[Tensor, " ..."]) -> Float[Tensor, " ..."]:
    return silu(in_features)


def run_softmax(in_features: Float[Tensor, " ..."], dim: int) -> Float[Tensor, " ..."]:
    return softmax(in_features, dim)


# --- Training parts (tlm-optim, tlm-train), then the tokenizer (not in tlm yet) ----------------


def run_get_batch(
    dataset: npt.NDArray, batch_size: int, context_length: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return get_batch(dataset, batch_size, context_length, device)


def run_cross_entropy(
    inputs: Float[Tensor, " batch_size vocab_size"], targets: Int[Tensor, " batch_size"]
) -> Float[Tensor, ""]:
    return cross_entropy(inputs, targets)


def run_gradient_clipping(parameters: Iterable[torch.nn.Parameter], max_l2_norm: float) -> None:
    clip_grad_norm_(parameters, max_l2_norm)


def get_adamw_cls() -> Any:
    return AdamW


def run_get_lr_cosine_schedule(
    it: int, max_learning_rate: float, min_learning_rate: float, warmup_iters: int, cosine_cycle_iters: int
) -> float:
    return cosine_lr(it, max_learning_rate, min_learning_rate, warmup_iters, cosine_cycle_iters)


def run_save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    iteration: int,
    out: str | os.PathLike | BinaryIO | IO[bytes],
) -> None:
    save_checkpoint(model, optimizer, iteration, out)


def run_load_checkpoint(
    src: str | os.PathLike | BinaryIO | IO[bytes], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    return load_checkpoint(src, model, optimizer)


def get_tokenizer(
    vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]], special_tokens: list[str] | None = None
) -> Any:
    return Tokenizer(vocab, merges, special_tokens)


def run_train_bpe(
    input_path: str | os.PathLike, vocab_size: int, special_tokens: list[str], **kwargs: Any
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    return train_bpe(input_path, vocab_size, special_tokens, **kwargs)
