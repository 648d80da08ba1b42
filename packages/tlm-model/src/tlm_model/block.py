"""The pre-norm Transformer block of CS336 §1.5 (Figure 2)."""

import torch
from jaxtyping import Float, Integer
from torch import Tensor, nn

from tlm_attention import CausalMultiHeadSelfAttention, KVCache
from tlm_ffn import SwiGLU
from tlm_norm import RMSNorm
from tlm_rope import RotaryPositionalEmbedding


class TransformerBlock(nn.Module):
    """y = x + attn(ln1(x)); z = y + ffn(ln2(y)).

    Normalising the sublayer *inputs* leaves a residual stream with no normalisation on it from
    the embedding to the final norm, which trains more stably than post-norm (Xiong et al. 2020).

    ``rope`` lets a model share one RoPE table across its layers; without it the block builds
    its own from ``theta`` and ``max_seq_len``. State-dict keys: ``attn.{q,k,v,output}_proj.weight``,
    ``ln1.weight``, ``ffn.w{1,2,3}.weight``, ``ln2.weight``, whether or not ``fused`` stacks q/k/v
    and w1/w3 into single matmuls. ``attention_backend`` is one of ``tlm_attention.BACKENDS``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        max_seq_len: int,
        theta: float,
        *,
        norm_eps: float = 1e-5,
        rope: RotaryPositionalEmbedding | None = None,
        attention_backend: str = "auto",
        fused: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.attn = CausalMultiHeadSelfAttention(
            d_model, num_heads, rope=rope, device=device, dtype=dtype, backend=attention_backend, fused_qkv=fused
        )
        if rope is None:
            # Built after the attention module, which has validated d_model and num_heads.
            self.attn.rope = RotaryPositionalEmbedding(theta, self.attn.d_head, max_seq_len, device=device)
        self.ln1 = RMSNorm(d_model, eps=norm_eps, device=device, dtype=dtype)
        self.ffn = SwiGLU(d_model, d_ff, device=device, dtype=dtype, fused=fused)
        self.ln2 = RMSNorm(d_model, eps=norm_eps, device=device, dtype=dtype)

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        token_positions: Integer[Tensor, "... seq"] | None = None,
        kv_cache: KVCache | None = None,
    ) -> Float[Tensor, "... seq d_model"]:
        x = x + self.attn(self.ln1(x), token_positions, kv_cache)
        return x + self.ffn(self.ln2(x))
