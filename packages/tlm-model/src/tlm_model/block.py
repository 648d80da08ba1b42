"""The Transformer block of CS336 §1.5 (Figure 2): pre-norm, or the §7 ablations' post-norm and no norm."""

import torch
from jaxtyping import Float, Integer
from torch import Tensor, nn

from tlm_attention import CacheStep, CausalMultiHeadSelfAttention, KVCache
from tlm_ffn import SiLUFFN, SwiGLU
from tlm_model.config import ModelConfig, check_config
from tlm_norm import RMSNorm
from tlm_rope import RotaryPositionalEmbedding


def build_rope(config: ModelConfig, device: torch.device | str | None = None) -> RotaryPositionalEmbedding | None:
    """The RoPE table a model of ``config`` uses: one per model, shared by its layers; None with
    ``positions="none"`` (NoPE)."""
    if config.positions == "none":
        return None
    return RotaryPositionalEmbedding(
        config.rope_theta,
        config.d_head,
        config.context_length,
        device=device,
        scaling=config.rope_scaling,
        layout=config.rope_layout,
    )


def build_norm(
    config: ModelConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """An RMSNorm of ``config``'s width and epsilon, or an identity with ``norm_placement="none"``."""
    if config.norm_placement == "none":
        return nn.Identity()
    return RMSNorm(config.d_model, eps=config.norm_eps, device=device, dtype=dtype)


def build_ffn(
    config: ModelConfig,
    *,
    fused: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> SwiGLU | SiLUFFN:
    """The feed-forward of ``config.ffn``: SwiGLU (``fused`` stacks w1/w3) or the two-matrix SiLU FFN."""
    if config.ffn == "silu":
        return SiLUFFN(config.d_model, config.d_ff, device=device, dtype=dtype)
    return SwiGLU(config.d_model, config.d_ff, device=device, dtype=dtype, fused=fused)


class TransformerBlock(nn.Module):
    """y = x + attn(ln1(x)); z = y + ffn(ln2(y)), with ``norm_placement="pre"`` (the default).

    Normalising the sublayer *inputs* leaves a residual stream with no normalisation on it from
    the embedding to the final norm, which trains more stably than post-norm (Xiong et al. 2020).
    The config's ``norm_placement`` selects the ablations: ``"post"`` is y = ln1(x + attn(x));
    z = ln2(y + ffn(y)) (Vaswani et al. 2017), ``"none"`` is y = x + attn(x); z = y + ffn(y) with
    ``ln1``/``ln2`` identities that hold no weights.

    Built from a :class:`ModelConfig` (its d_model, heads, d_ff, norm_eps, RoPE fields and the
    ablation fields ``norm_placement``, ``positions`` and ``ffn``; the vocabulary and layer count are
    not used here). ``rope`` is the RoPE module a model shares across its layers; without it the
    block builds its own from the config (none with ``positions="none"``). State-dict keys:
    ``attn.{q,k,v,output}_proj.weight``, ``ln1.weight``, ``ffn.w{1,2,3}.weight``, ``ln2.weight``,
    (and ``attn.{q,k,v}_proj.bias`` with ``qkv_bias``),
    whether or not ``fused`` (the default) stacks q/k/v and w1/w3 into single matmuls; no
    ``ln*.weight`` without norms, no ``ffn.w3.weight`` with ``ffn="silu"``.
    ``attention_backend`` is one of ``tlm_attention.BACKENDS``.
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
        check_config(config)
        if rope is not None and config.positions == "none":
            raise ValueError("rope was given but config.positions is 'none' (NoPE); pass rope=None")
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
            qkv_bias=config.qkv_bias,
        )
        self.ln1 = build_norm(config, device, dtype)
        self.ffn = build_ffn(config, fused=fused, device=device, dtype=dtype)
        self.ln2 = build_norm(config, device, dtype)
        self.post_norm = config.norm_placement == "post"

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        token_positions: Integer[Tensor, "... seq"] | None = None,
        kv_cache: KVCache | CacheStep | None = None,
        *,
        document_ids: Integer[Tensor, "... seq"] | None = None,
    ) -> Float[Tensor, "... seq d_model"]:
        if self.post_norm:
            x = self.ln1(x + self.attn(x, token_positions, kv_cache, document_ids=document_ids))
            return self.ln2(x + self.ffn(x))
        x = x + self.attn(self.ln1(x), token_positions, kv_cache, document_ids=document_ids)
        return x + self.ffn(self.ln2(x))
