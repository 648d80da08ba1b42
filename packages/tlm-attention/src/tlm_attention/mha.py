"""Causal multi-head self-attention with optional rotary position embedding."""

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor, nn

from tlm_attention.sdpa import scaled_dot_product_attention
from tlm_linear import Linear
from tlm_rope import RotaryPositionalEmbedding


class CausalMultiHeadSelfAttention(nn.Module):
    """MultiHeadSelfAttention(x) = W_O · MultiHead(W_Q x, W_K x, W_V x) with a causal mask.

    d_k = d_v = d_model / num_heads. Submodules ``q_proj``, ``k_proj``, ``v_proj`` and
    ``output_proj`` fix the state-dict keys. ``rope``, when given, rotates q and k of every
    head by the same position-dependent rotation (never v); one RoPE module can be shared by
    all layers of a model.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rope: RotaryPositionalEmbedding | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
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
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.rope = rope

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        token_positions: Int[Tensor, "... seq"] | None = None,
    ) -> Float[Tensor, "... seq d_model"]:
        if x.ndim < 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (..., seq, d_model={self.d_model}), got {tuple(x.shape)}")
        if token_positions is not None and self.rope is None:
            raise ValueError("token_positions was given but this attention module has no rope to use it")

        split = "... seq (heads d_head) -> ... heads seq d_head"
        q = rearrange(self.q_proj(x), split, heads=self.num_heads)
        k = rearrange(self.k_proj(x), split, heads=self.num_heads)
        v = rearrange(self.v_proj(x), split, heads=self.num_heads)
        if self.rope is not None:
            # Positions are (..., seq); a unit heads axis applies the same rotation to every head.
            positions = None if token_positions is None else rearrange(token_positions, "... seq -> ... 1 seq")
            q = self.rope(q, positions)
            k = self.rope(k, positions)

        seq = x.shape[-2]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        out = scaled_dot_product_attention(q, k, v, causal)
        return self.output_proj(rearrange(out, "... heads seq d_head -> ... seq (heads d_head)"))
