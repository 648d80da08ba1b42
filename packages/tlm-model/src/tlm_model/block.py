"""The pre-norm Transformer block of CS336 §1.5 (Figure 2)."""

import torch
from jaxtyping import Float, Integer
from torch import Tensor, nn

from tlm_attention import CausalMultiHeadSelfAttention, KVCache
from tlm_ffn import SwiGLU
from tlm_model._checks import check_positive_int
from tlm_norm import RMSNorm
from tlm_rope import RotaryPositionalEmbedding


class TransformerBlock(nn.Module):
    """y = x + attn(ln1(x)); z = y + ffn(ln2(y)).

    Normalising the sublayer *inputs* leaves a residual stream with no normalisation on it from
    the embedding to the final norm, which trains more stably than post-norm (Xiong et al. 2020).

    Positions come either from ``max_seq_len`` and ``theta`` (the block builds its own RoPE) or
    from ``rope``, a RoPE module built once by the caller and shared by its layers; giving both
    is refused. State-dict keys: ``attn.{q,k,v,output}_proj.weight``, ``ln1.weight``,
    ``ffn.w{1,2,3}.weight``, ``ln2.weight``, whether or not ``fused`` (the default) stacks q/k/v
    and w1/w3 into single matmuls. ``attention_backend`` is ``"auto"`` or a key of
    ``tlm_attention.ATTENTION_BACKENDS``. ``num_kv_heads`` and ``head_dim`` go to the attention
    (grouped-query attention; a head size other than d_model / num_heads).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        max_seq_len: int | None = None,
        theta: float | None = None,
        *,
        norm_eps: float = 1e-5,
        rope: RotaryPositionalEmbedding | None = None,
        attention_backend: str = "auto",
        fused: bool = True,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if rope is None:
            if max_seq_len is None or theta is None:
                raise ValueError(
                    "TransformerBlock needs either max_seq_len and theta (to build its RoPE) or rope, "
                    f"got max_seq_len={max_seq_len!r}, theta={theta!r}, rope=None"
                )
            check_positive_int("d_model", d_model)
            check_positive_int("num_heads", num_heads)
            if head_dim is None and d_model % num_heads != 0:
                raise ValueError(
                    f"d_model must be divisible by num_heads, got d_model={d_model}, num_heads={num_heads}"
                )
            d_head = d_model // num_heads if head_dim is None else check_positive_int("head_dim", head_dim)
            rope = RotaryPositionalEmbedding(theta, d_head, max_seq_len, device=device)
        elif max_seq_len is not None or theta is not None:
            raise ValueError(
                "give TransformerBlock either rope or max_seq_len and theta, not both: the rope's own "
                f"max_seq_len={getattr(rope, 'max_seq_len', '?')}, theta={getattr(rope, 'theta', '?')} would "
                f"silently win over max_seq_len={max_seq_len!r}, theta={theta!r}"
            )
        self.attn = CausalMultiHeadSelfAttention(
            d_model,
            num_heads,
            rope=rope,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            fused=fused,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
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
