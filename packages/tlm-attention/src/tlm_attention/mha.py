"""Causal multi-head self-attention with optional rotary position embedding and a KV cache."""

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float, Integer
from torch import Tensor, nn

from tlm_attention.blockwise import blockwise_attention
from tlm_attention.kv_cache import KVCache
from tlm_attention.sdpa import scaled_dot_product_attention
from tlm_linear import Linear, register_split_layout
from tlm_rope import RotaryPositionalEmbedding

#: Attention implementations a module can use; all compute the same causal attention.
#: "reference": tlm's own softmax(QKᵀ/√d)V with a boolean mask (what the course grades);
#: "blockwise": online softmax over key blocks in plain PyTorch, O(seq) memory, causal blocks skipped;
#: "torch": torch.nn.functional.scaled_dot_product_attention, fused kernels;
#: "auto": "torch", the fastest here (in causal self-attention no row is ever fully masked, so
#: torch's NaN for such rows cannot occur).
BACKENDS = ("auto", "reference", "blockwise", "torch")


def causal_attention(q: Tensor, k: Tensor, v: Tensor, backend: str = "auto") -> Tensor:
    """Causal attention of (..., queries, d) over (..., keys, d), bottom-right aligned.

    Query i sees keys j <= i + (keys - queries): ordinary causal attention when queries == keys,
    and new tokens attending to themselves and everything cached before them otherwise.
    """
    num_q, num_k = q.shape[-2], k.shape[-2]
    if backend == "blockwise":
        return blockwise_attention(q, k, v, causal=True)
    if backend == "reference":
        mask = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).tril(num_k - num_q)
        return scaled_dot_product_attention(q, k, v, mask)
    if num_q == num_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if num_q == 1:  # one new token sees the whole cache
        return F.scaled_dot_product_attention(q, k, v)
    # torch's is_causal aligns top-left, which is wrong once a cache offsets the queries.
    mask = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).tril(num_k - num_q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _check_positions(token_positions: object, lead_shape: torch.Size) -> None:
    # Checked here, before a heads axis is added, so the message quotes the caller's shapes.
    if not isinstance(token_positions, Tensor):
        raise TypeError(f"token_positions must be a torch.Tensor, got {type(token_positions).__name__}")
    try:
        fits = torch.broadcast_shapes(token_positions.shape, lead_shape) == lead_shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"token_positions of shape {tuple(token_positions.shape)} must broadcast to the input's "
            f"(..., seq) = {tuple(lead_shape)}"
        )


class CausalMultiHeadSelfAttention(nn.Module):
    """MultiHeadSelfAttention(x) = W_O · MultiHead(W_Q x, W_K x, W_V x) with a causal mask.

    d_k = d_v = d_model / num_heads. Submodules ``q_proj``, ``k_proj``, ``v_proj`` and
    ``output_proj`` fix the state-dict keys. ``rope``, when given, rotates q and k of every
    head by the same position-dependent rotation (never v); one RoPE module can be shared by
    all layers of a model.

    ``backend`` picks the attention implementation (see :data:`BACKENDS`). ``fused_qkv=True``
    computes q, k and v with one matmul against a stacked (3·d_model, d_model) weight
    ``qkv_proj``; state dicts keep (and accept) the separate q/k/v keys either way.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rope: RotaryPositionalEmbedding | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        backend: str = "auto",
        fused_qkv: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if d_model % num_heads != 0:
            raise ValueError(f"d_model must be divisible by num_heads, got d_model={d_model}, num_heads={num_heads}")
        d_head = d_model // num_heads
        if rope is not None:
            if not isinstance(rope, RotaryPositionalEmbedding):
                raise TypeError(f"rope must be a RotaryPositionalEmbedding or None, got {type(rope).__name__}")
            if rope.d_k != d_head:
                raise ValueError(f"rope.d_k must equal d_model / num_heads = {d_head}, got rope.d_k={rope.d_k}")
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_head = d_head
        self.backend = backend  # validated by the setter below
        self.fused_qkv = bool(fused_qkv)
        if self.fused_qkv:
            # Each third keeps the σ² = 2 / (d_model + d_model) of a separate projection.
            std = math.sqrt(1.0 / d_model)
            self.qkv_proj = Linear(d_model, 3 * d_model, device=device, dtype=dtype, init_std=std)
            register_split_layout(self, "qkv_proj", {"q_proj": d_model, "k_proj": d_model, "v_proj": d_model})
        else:
            self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
            self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
            self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.rope = rope

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        if value not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {value!r}")
        self._backend = value

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        token_positions: Integer[Tensor, "... seq"] | None = None,
        kv_cache: KVCache | None = None,
    ) -> Float[Tensor, "... seq d_model"]:
        """Attend causally over ``x``; with ``kv_cache``, also over the tokens cached before it.

        Without explicit ``token_positions`` the tokens sit at positions ``kv_cache.length``
        onwards (0 onwards without a cache).
        """
        if x.ndim < 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (..., seq, d_model={self.d_model}), got {tuple(x.shape)}")
        if token_positions is not None and self.rope is None:
            raise ValueError("token_positions was given but this attention module has no rope to use it")
        if token_positions is not None:
            _check_positions(token_positions, x.shape[:-1])
        if kv_cache is not None and x.ndim != 3:
            raise ValueError(f"with a kv_cache, x must have shape (batch, seq, d_model), got {tuple(x.shape)}")

        if self.fused_qkv:
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        split = "... seq (heads d_head) -> ... heads seq d_head"
        q, k, v = (rearrange(t, split, heads=self.num_heads) for t in (q, k, v))

        start = 0 if kv_cache is None else kv_cache.length
        if self.rope is not None:
            if token_positions is None and start > 0:
                token_positions = torch.arange(start, start + x.shape[-2], device=x.device)
            # Positions are (..., seq); a unit heads axis applies the same rotation to every head.
            positions = None if token_positions is None else rearrange(token_positions, "... seq -> ... 1 seq")
            q = self.rope(q, positions)
            k = self.rope(k, positions)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)

        out = causal_attention(q, k, v, self._backend)
        return self.output_proj(rearrange(out, "... heads seq d_head -> ... seq (heads d_head)"))

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, backend={self._backend!r}, fused_qkv={self.fused_qkv}"
        )
