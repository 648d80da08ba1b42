"""Causal multi-head self-attention with optional rotary position embedding and a KV cache."""

import math
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Float, Integer
from torch import Tensor, nn

from tlm_attention.backends import attention_function, resolve_attention_backend
from tlm_attention.documents import document_mask, flex_applies, flex_document_attention
from tlm_attention.heads import head_layout
from tlm_attention.kv_cache import CacheStep, KVCache, cache_mask
from tlm_core.checks import check_bool
from tlm_linear import Linear, register_split_layout
from tlm_rope import RotaryPositionalEmbedding


class CausalMultiHeadSelfAttention(nn.Module):
    """MultiHeadSelfAttention(x) = W_O · MultiHead(W_Q x, W_K x, W_V x) with a causal mask.

    ``num_kv_heads`` (default ``num_heads``) key/value heads are shared by groups of
    ``num_heads / num_kv_heads`` query heads: grouped-query attention (Ainslie et al. 2023), or
    multi-query attention with ``num_kv_heads=1``. ``head_dim`` defaults to d_model / num_heads and
    may be set independently (Gemma, Qwen3). Submodules ``q_proj`` (num_heads·head_dim, d_model),
    ``k_proj``/``v_proj`` (num_kv_heads·head_dim, d_model) and ``output_proj`` (d_model,
    num_heads·head_dim) fix the state-dict keys. ``rope``, when given, rotates q and k of every
    head by the same position-dependent rotation (never v); one RoPE module can be shared by
    all layers of a model. Without it (``rope=None``) q and k are used as projected: attention with
    no positional signal (NoPE), where only the causal mask tells tokens apart by position
    (Haviv et al. 2022; Kazemnejad et al. 2023), and ``token_positions`` has nothing to act on.

    ``attention_backend`` names the attention implementation (one of :data:`~tlm_attention.BACKENDS`); it is
    resolved once, here, and an unknown name is refused here. ``fused=True`` (the default) computes q, k
    and v with one matmul against a stacked (3·d_model, d_model) weight ``qkv_proj``; state
    dicts keep (and accept) the separate q/k/v keys either way. A :class:`KVCache` for this
    module holds ``num_kv_heads`` heads, so its memory is ∝ ``num_kv_heads``.

    ``qkv_bias=True`` adds a learned bias to q, k and v (Qwen2's attention; the output projection has
    none). It is one parameter ``qkv_bias`` (q's rows, then k's, then v's), zero at initialisation,
    kept outside the projections so that a LoRA adapter on them leaves it alone; state dicts present it
    as ``q_proj.bias``, ``k_proj.bias`` and ``v_proj.bias`` (and accept those keys). The default,
    False, has no such parameter: the course's model and every state dict without biases are unchanged.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rope: RotaryPositionalEmbedding | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        attention_backend: str = "auto",
        fused: bool = True,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        num_kv_heads, d_head = head_layout(d_model, num_heads, num_kv_heads, head_dim)
        if rope is not None:
            if not isinstance(rope, RotaryPositionalEmbedding):
                raise TypeError(f"rope must be a RotaryPositionalEmbedding or None, got {type(rope).__name__}")
            if rope.d_k != d_head:
                raise ValueError(
                    f"rope.d_k must equal d_model / num_heads = {d_head}, got rope.d_k={rope.d_k} (or set head_dim)"
                )
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.d_head = d_head
        q_size, kv_size = num_heads * d_head, num_kv_heads * d_head
        self._split_sizes = (q_size, kv_size, kv_size)
        self._requested_backend = attention_backend
        self._backend = resolve_attention_backend(attention_backend)
        self._attention_fn = attention_function(self._backend)  # chosen once, not on every call
        self.fused = bool(fused)
        if self.fused:
            # The stack keeps q's σ² = 2 / (d_model + heads·d_head) (k's and v's too without GQA).
            std = math.sqrt(2.0 / (d_model + q_size))
            self.qkv_proj = Linear(d_model, q_size + 2 * kv_size, device=device, dtype=dtype, init_std=std)
            register_split_layout(self, "qkv_proj", {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size})
        else:
            self.q_proj = Linear(d_model, q_size, device=device, dtype=dtype)
            self.k_proj = Linear(d_model, kv_size, device=device, dtype=dtype)
            self.v_proj = Linear(d_model, kv_size, device=device, dtype=dtype)
        self.output_proj = Linear(q_size, d_model, device=device, dtype=dtype)
        self.rope = rope
        self.qkv_bias: nn.Parameter | None
        if check_bool("qkv_bias", qkv_bias):
            self.qkv_bias = nn.Parameter(torch.zeros(q_size + 2 * kv_size, device=device, dtype=dtype))
            parts = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
            self.register_state_dict_post_hook(_SplitBias(parts))
            self.register_load_state_dict_pre_hook(_JoinBias(parts))
        else:
            self.register_parameter("qkv_bias", None)

    def reset_parameters(self) -> None:
        """Zero the q/k/v bias (the projections reset themselves); nothing without ``qkv_bias``."""
        if self.qkv_bias is not None:
            with torch.no_grad():
                self.qkv_bias.zero_()

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k and v of ``x`` (..., seq, heads·d_head each), biases added."""
        if self.fused:
            qkv = self.qkv_proj(x)
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias.to(qkv.dtype)
            q, k, v = qkv.split(self._split_sizes, dim=-1)
            return q, k, v
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qkv_bias is not None:
            bq, bk, bv = self.qkv_bias.to(q.dtype).split(self._split_sizes)
            q, k, v = q + bq, k + bk, v + bv
        return q, k, v

    @property
    def attention_backend(self) -> str:
        """The name this module was given ("auto" stays "auto"; see :attr:`resolved_attention_backend`)."""
        return self._requested_backend

    @attention_backend.setter
    def attention_backend(self, name: str) -> None:
        self._backend = resolve_attention_backend(name)
        self._attention_fn = attention_function(self._backend)
        self._requested_backend = name

    @property
    def resolved_attention_backend(self) -> str:
        """The implementation that runs (what "auto" resolved to)."""
        return self._backend

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        token_positions: Integer[Tensor, "... seq"] | None = None,
        kv_cache: KVCache | CacheStep | None = None,
        *,
        document_ids: Integer[Tensor, "... seq"] | None = None,
    ) -> Float[Tensor, "... seq d_model"]:
        """Attend causally over ``x``; with ``kv_cache``, also over the tokens cached before it.

        ``document_ids`` (one id per token, equal within a document: :func:`~tlm_attention.document_ids`)
        restricts attention to each token's own document, for windows packed with several; give the
        positions within each document as ``token_positions`` (:func:`~tlm_attention.document_positions`)
        to restart RoPE with each. It is for training and scoring, not with a ``kv_cache``.

        A :class:`~tlm_attention.kv_cache.CacheStep` (a model's step over its cache, one per layer) writes the
        new keys and values at its slots and attends over the rows' buffers under its mask, ``token_positions``
        being the RoPE positions. A one-layer :class:`KVCache` is that step with every row continued at its own
        length and advanced after it (``x`` (batch, seq, d_model), no ``token_positions``). Nothing here reads a
        value back to the host.
        """
        if isinstance(kv_cache, KVCache):
            if token_positions is not None or document_ids is not None:
                raise ValueError("with a KVCache each row continues at its own length: no token_positions or "
                                 "document_ids")  # fmt: skip
            if kv_cache.key_buffers[0].shape[1::2] != (self.num_kv_heads, self.d_head):
                raise ValueError(f"kv_cache must hold (heads, d_head) = ({self.num_kv_heads}, {self.d_head}), got "
                                 f"{tuple(kv_cache.key_buffers[0].shape[1::2])}")  # fmt: skip
            positions, slots = kv_cache.continuation(x.shape[-2])
            mask = cache_mask(positions, kv_cache.capacity, slots)
            out = self._static_step(x, positions, CacheStep(kv_cache, 0, positions, None, mask, slots.shape[0]))
            kv_cache.advance([x.shape[-2]] * kv_cache.batch_size)
            return out
        if kv_cache is not None:
            return self._static_step(x, token_positions, kv_cache)
        if token_positions is not None and self.rope is None:
            raise ValueError("token_positions was given but this attention module has no rope to use it")

        q, k, v = self._heads(x, token_positions)
        if document_ids is not None and self._backend == "torch" and flex_applies(q, document_ids):
            # On CUDA, torch's attention within documents is FlexAttention's: a block mask, not a (seq, seq) one.
            out = flex_document_attention(q, k, v, document_ids)
        elif document_ids is not None:
            # Causal within each document: every backend takes the mask in place of the causal one.
            out = attention_function(self._backend, within_causal=True)(q, k, v, mask=document_mask(document_ids))
        else:
            out = self._attention_fn(q, k, v)
        return self.output_proj(rearrange(out, "... heads seq d_head -> ... seq (heads d_head)"))

    def _heads(self, x: Tensor, token_positions: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """q, k and v of ``x`` split into heads (..., heads, seq, d_head), q and k rotated at ``token_positions``
        (None: 0, 1, ...); a unit heads axis applies the same rotation to every head."""
        split = "... seq (heads d_head) -> ... heads seq d_head"
        q, k, v = (rearrange(t, split, d_head=self.d_head) for t in self._project(x))
        if self.rope is not None and token_positions is None:
            q, k = self.rope(q), self.rope(k)
        elif self.rope is not None:
            positions = rearrange(token_positions, "... seq -> ... 1 seq")
            q, k = self.rope(q, positions), self.rope(k, positions)
        return q, k, v

    def _static_step(self, x: Tensor, rope_positions: Tensor | None, step: CacheStep) -> Tensor:
        q, k, v = self._heads(x, rope_positions)
        keys, values = step.cache.write(step.layer, k, v, step.positions, step.rows, step.limit)
        out = self._attention_fn(q, keys, values, mask=step.mask)
        return self.output_proj(rearrange(out, "batch heads seq d_head -> batch seq (heads d_head)"))

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.d_head}, qkv_bias={self.qkv_bias is not None}, "
            f"attention_backend={self._requested_backend!r} ({self._backend}), fused={self.fused}"
        )


class _SplitBias:
    # Callable objects, as tlm_linear.fused's hooks, so that a module carrying them still pickles.
    def __init__(self, parts: dict[str, int]) -> None:
        self.names, self.sizes = list(parts), list(parts.values())

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        bias = state_dict.pop(prefix + "qkv_bias")
        for name, block in zip(self.names, torch.split(bias, self.sizes), strict=True):
            state_dict[f"{prefix}{name}.bias"] = block.clone()  # separate storage, as safetensors needs


class _JoinBias(_SplitBias):
    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        keys = [f"{prefix}{name}.bias" for name in self.names]
        if prefix + "qkv_bias" not in state_dict and all(k in state_dict for k in keys):
            state_dict[prefix + "qkv_bias"] = torch.cat([state_dict.pop(k) for k in keys])
