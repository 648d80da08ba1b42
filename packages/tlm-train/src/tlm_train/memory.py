"""Per-rank training memory under DDP and FSDP2, as :func:`tlm_train.wrap_model` wraps a model:
parameters, gradients, AdamW state, activations.

- **DDP** keeps a full replica on every rank: parameters, gradients and AdamW's two moments
  are all ``4 × P`` bytes each in float32 (16 B/parameter in all), whatever the number of ranks
  (with ``gradient_as_bucket_view=True``, as tlm-train wraps it; otherwise DDP's all-reduce
  buckets hold a second copy of the gradients).
- **FSDP2** (``fully_shard``) splits every parameter along its first dimension into ``N`` chunks of
  ``ceil(rows / N)`` rows (the last ranks may get fewer, or none); gradients and AdamW state are
  sharded the same way, so rank ``r`` holds exactly the rows :func:`shard_rows` gives it. While a
  block runs forward or backward its full parameters are gathered (one block at a time, plus the
  root's embedding, final norm and LM head): that transient is ``gathered_bytes``.
- **Activations** (what autograd keeps for the backward pass), float32, counted from what this
  implementation saves. Per token and layer: each RMSNorm's input and its 1/rms, and its output,
  which the next projection saves (2 × (2·d + 1)); the SDPA inputs and output (q and out:
  heads·d_head each; k and v: kv_heads·d_head each, so grouped-query attention saves less) and its
  log-sum-exp (heads), the output projection reading SDPA's output as it is (RoPE keeps q's
  (seq, heads) memory order, so no copy is made); SwiGLU's gate, up and product (3·d_ff). Outside
  the blocks, per token: the final norm's input and 1/rms with the loss's gradient of the hidden
  states (2·d + 1) and the int64 ids; per step:
  the chunked loss's gradient of the LM head (vocab·d), computed in the forward pass, and the
  RoPE cos/sin tables (seq·d_head, shared by the layers). With per-block activation
  checkpointing only each block's input (d) is kept after the forward pass (``activations``),
  and one block's activations are rebuilt at a time during the backward pass (``recomputed``).
- **The ablations** (:class:`~tlm_model.ModelConfig`'s ``norm_placement``, ``positions``, ``ffn``), as
  built: post-norm saves what pre-norm does (each norm's input, 1/rms and output, in another
  order); no norm leaves each sublayer's projections saving their input (2·d per layer) and the
  final norm's input and 1/rms gone (d + 1 per token); NoPE has no RoPE tables; the SiLU FFN saves
  w1's output, its sigmoid and their product (3·d_ff, like SwiGLU's three, at its own d_ff).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tlm_core.checks import check_choice, check_int
from tlm_model.accounting import human, shape_model
from tlm_model.config import ModelConfig

MODES = ("ddp", "fsdp")
_F32 = 4


def shard_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of a parameter with ``rows`` rows that FSDP2 places on ``rank`` of ``world_size``."""
    chunk = math.ceil(rows / world_size)
    return max(0, min(chunk, rows - rank * chunk))


def parameter_shapes(config: ModelConfig) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(the shapes of one block's parameters, the shapes of the rest: the root module's), read from the
    model built unfused on the meta device, as :func:`tlm_train.build_model` builds it."""
    model = shape_model(config)
    block = [tuple(p.shape) for p in model.layers[0].parameters()]
    in_blocks = {id(p) for layer in model.layers for p in layer.parameters()}
    root = [tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks]  # a tied head is the embedding
    return block, root


@dataclass(frozen=True)
class TrainMemory:
    """Bytes on one rank (float32 weights, gradients and AdamW moments)."""

    mode: str
    world_size: int
    rank: int
    tokens: int  # this rank's tokens per micro-batch
    parameters: int
    gradients: int
    optimizer: int  # AdamW's exp_avg and exp_avg_sq
    gathered: int  # FSDP2: the largest unsharded block (or the root) held while it runs; DDP: 0
    activations: int  # kept from the forward pass to the backward pass
    recomputed: int  # activation checkpointing: one block's activations, rebuilt during backward
    activation_checkpointing: bool

    @property
    def activations_per_token(self) -> float:
        return self.activations / self.tokens

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations + self.recomputed


def block_activation_bytes_per_token(config: ModelConfig) -> int:
    """Bytes one block saves per token for its backward pass (see the module docstring)."""
    d, q, kv = config.d_model, config.num_heads * config.d_head, config.kv_heads * config.d_head
    # Two RMSNorms: input and 1/rms, and the output the projection saves (pre- or post-norm alike);
    # without norms the projections save the sublayer inputs themselves.
    norms = 2 * d if config.norm_placement == "none" else 2 * (2 * d + 1)
    attention = 2 * q + 2 * kv + config.num_heads  # q, k, v, out (the output projection's input); log-sum-exp
    ffn = 3 * config.d_ff  # SwiGLU: gate, up, product; SiLU FFN: w1's output, its sigmoid, product
    return (norms + attention + ffn) * _F32


def activation_bytes_per_token(config: ModelConfig, *, activation_checkpointing: bool = False) -> int:
    """Bytes autograd keeps per token from the forward pass to the backward pass."""
    final_norm = 0 if config.norm_placement == "none" else config.d_model + 1  # its input and 1/rms
    outside = (final_norm + config.d_model) * _F32 + 8  # the final norm; loss gradient w.r.t. hidden; ids
    if activation_checkpointing:
        return config.num_layers * config.d_model * _F32 + outside  # each block's input only
    return config.num_layers * block_activation_bytes_per_token(config) + outside


def train_memory(
    config: ModelConfig,
    *,
    mode: str = "ddp",
    world_size: int = 1,
    rank: int = 0,
    batch_size: int = 1,
    seq_len: int | None = None,
    activation_checkpointing: bool = False,
) -> TrainMemory:
    """Training memory of ``rank`` when ``batch_size`` sequences of ``seq_len`` tokens (the
    context length by default) run on each rank, under ``mode`` (``"ddp"`` or ``"fsdp"``)."""
    check_choice("mode", mode, MODES)
    check_int("world_size", world_size, low=1)
    check_int("rank", rank, low=0)
    check_int("batch_size", batch_size, low=1)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
    seq_len = config.context_length if seq_len is None else seq_len
    block_shapes, root_shapes = parameter_shapes(config)
    shapes = block_shapes * config.num_layers + root_shapes
    if mode == "ddp":
        local = sum(math.prod(s) for s in shapes)
        gathered = 0
    else:
        local = sum(shard_rows(s[0], world_size, rank) * math.prod(s[1:]) for s in shapes)
        block = sum(math.prod(s) for s in block_shapes)
        # The root (the embedding, the final norm and, unless tied, the LM head) stays gathered for the
        # whole step (FSDP2 reshards it only after backward); one block is gathered at a time beside it.
        gathered = (sum(math.prod(s) for s in root_shapes) + block) * _F32 if world_size > 1 else 0
    tokens = batch_size * seq_len
    # The RoPE cos and sin tables, saved by the blocks (none with NoPE).
    rope = 0 if config.positions == "none" else seq_len * config.d_head * _F32
    return TrainMemory(
        mode=mode,
        world_size=world_size,
        rank=rank,
        tokens=tokens,
        parameters=local * _F32,
        gradients=local * _F32,
        optimizer=2 * local * _F32,
        gathered=gathered,
        activations=tokens * activation_bytes_per_token(config, activation_checkpointing=activation_checkpointing)
        + config.vocab_size * config.d_model * _F32  # the LM head's gradient, held from forward to backward
        + (0 if activation_checkpointing else rope),
        recomputed=tokens * block_activation_bytes_per_token(config) + rope if activation_checkpointing else 0,
        activation_checkpointing=activation_checkpointing,
    )


def memory_table(memory: Sequence[TrainMemory]) -> str:
    """One column per :class:`TrainMemory` (e.g. DDP and FSDP2 for the same rank): what ``tlm accounting
    --world-size N`` prints."""
    first = memory[0]
    checkpointing = "with" if first.activation_checkpointing else "without"
    lines = [
        f"Training memory per rank (rank {first.rank} of {first.world_size}, {first.tokens:,} tokens per rank and "
        f"micro-batch, float32, AdamW, {checkpointing} activation checkpointing):",
        f"  {'':<28}" + "".join(f"{m.mode.upper():>14}" for m in memory),
    ]
    rows = [
        ("parameters", "parameters"),
        ("gradients", "gradients"),
        ("AdamW state (m, v)", "optimizer"),
        ("gathered (FSDP2 unshard)", "gathered"),
        ("activations kept", "activations"),
        ("recomputed (one block)", "recomputed"),
    ]
    for label, field in rows:
        lines.append(f"  {label:<28}" + "".join(f"{human(getattr(m, field), 'B'):>14}" for m in memory))
    lines.append(f"  {'total':<28}" + "".join(f"{human(m.total, 'B'):>14}" for m in memory))
    lines.append(
        f"  {'activations per token':<28}" + "".join(f"{human(m.activations_per_token, 'B'):>14}" for m in memory)
    )
    return "\n".join(lines)
