"""The pre-norm Transformer block of CS336 §1.5 (Figure 2)."""

import torch
from jaxtyping import Float, Integer
from torch import Tensor, nn

from tlm_attention import CausalMultiHeadSelfAttention, KVCache
from tlm_ffn import SwiGLU
from tlm_model.config import ModelConfig
from tlm_norm import RMSNorm
from tlm_rope import RotaryPositionalEmbedding


def build_rope(config: ModelConfig, device: torch.device | str | None = None) -> RotaryPositionalEmbedding:
    """The RoPE table a model of ``config`` uses: one per model, shared by its layers."""
    return RotaryPositionalEmbedding(
        config.rope_theta,
        config.d_head,
        config.context_length,
        device=device,
        scaling=config.rope_scaling,
        layout=config.rope_layout,
    )


class TransformerBlock(nn.Module):
    """y = x + attn(ln1(x)); z = y + ffn(ln2(y)).

    Normalising the sublayer *inputs* leaves a residual stream with no normalisation on it from
    the embedding to the final norm, which trains more stably than post-norm (Xiong et al. 2020).

    Built from a :class:`ModelConfig` (its d_model, heads, d_ff, norm_eps and RoPE fields; the
    vocabulary and layer count are not used here). ``rope`` is the RoPE module a model shares across
    its layers; without it the block builds its own from the config. State-dict keys:
    ``attn.{q,k,v,output}_proj.weight``, ``ln1.weight``, ``ffn.w{1,2,3}.weight``, ``ln2.weight``,
    whether or not ``fused`` (the default) stacks q/k/v and w1/w3 into single matmuls.
    ``attention_backend`` is ``"auto"`` or a key of ``tlm_attention.ATTENTION_BACKENDS``.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        rope: RotaryPositionalEmbedding | None = None,
        attention_backend: str = "auto",
        fused: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        rope = build_rope(config, device) if rope is None else rope
        self.attn = CausalMultiHeadSelfAttention(
            config.d_model,
            config.num_heads,
            rope=rope,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            fused=fused,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        )
        self.ln1 = RMSNorm(config.d_model, eps=config.norm_eps, device=device, dtype=dtype)
        self.ffn = SwiGLU(config.d_model, config.d_ff, device=device, dtype=dtype, fused=fused)
        self.ln2 = RMSNorm(config.d_model, eps=config.norm_eps, device=device, dtype=dtype)

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        token_positions: Integer[Tensor, "... seq"] | None = None,
        kv_cache: KVCache | None = None,
    ) -> Float[Tensor, "... seq d_model"]:
        x = x + self.attn(self.ln1(x), token_positions, kv_cache)
        return x + self.ffn(self.ln2(x))
