"""The Transformer language model of CS336 §1.1 and §1.6 (Figure 1)."""

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from tlm_linear import Embedding, Linear
from tlm_model.block import TransformerBlock
from tlm_model.config import ModelConfig
from tlm_norm import RMSNorm
from tlm_rope import RotaryPositionalEmbedding

_COMPILED_PREFIX = "_orig_mod."


def _strip_compiled_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    # torch.compile wraps a model in an OptimizedModule whose state-dict keys all start with
    # "_orig_mod."; checkpoints saved from it should load into the plain model unchanged.
    # load_state_dict hands hooks its own copy of the dict, so the caller's dict is untouched.
    marked = prefix + _COMPILED_PREFIX
    for key in [k for k in state_dict if k.startswith(marked)]:
        state_dict[prefix + key[len(marked) :]] = state_dict.pop(key)


class TransformerLM(nn.Module):
    """token embedding → ``num_layers`` pre-norm blocks → final RMSNorm → LM head.

    ``forward`` returns unnormalised next-token logits (batch, seq, vocab). All layers share one
    RoPE table sized ``context_length``. State-dict keys: ``token_embeddings.weight``,
    ``layers.{i}.<block keys>``, ``ln_final.weight``, ``lm_head.weight``; checkpoints saved from a
    ``torch.compile``d model (keys prefixed ``_orig_mod.``) load as they are.

    Build on ``device="meta"`` to get shapes and parameter counts without allocating; then
    ``to_empty(device=...)`` and ``reset_parameters()`` to materialise it.
    """

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        rope_theta: float = 10_000.0,
        *,
        norm_eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = ModelConfig(
            vocab_size=vocab_size,
            context_length=context_length,
            d_model=d_model,
            num_layers=num_layers,
            num_heads=num_heads,
            d_ff=d_ff,
            rope_theta=rope_theta,
            norm_eps=norm_eps,
        )
        cfg = self.config
        self.token_embeddings = Embedding(vocab_size, d_model, device=device, dtype=dtype)
        self.rope = RotaryPositionalEmbedding(rope_theta, cfg.d_head, context_length, device=device)
        self.layers = nn.ModuleList(
            TransformerBlock(
                d_model,
                num_heads,
                d_ff,
                context_length,
                rope_theta,
                norm_eps=norm_eps,
                rope=self.rope,
                device=device,
                dtype=dtype,
            )
            for _ in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model, eps=norm_eps, device=device, dtype=dtype)
        self.lm_head = Linear(d_model, vocab_size, device=device, dtype=dtype)
        self.register_load_state_dict_pre_hook(_strip_compiled_prefix)

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> "TransformerLM":
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        return cls(**config.to_dict(), device=device, dtype=dtype)

    @classmethod
    def from_preset(
        cls, name: str, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> "TransformerLM":
        return cls.from_config(ModelConfig.from_preset(name), device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        """Re-draw every parameter with the CS336 §1.4.1 initialisation (e.g. after ``to_empty``)."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        in_indices: Int[Tensor, "... seq"],
        token_positions: Int[Tensor, "... seq"] | None = None,
    ) -> Float[Tensor, "... seq vocab"]:
        if not isinstance(in_indices, Tensor):
            raise TypeError(f"in_indices must be a torch.Tensor of token ids, got {type(in_indices).__name__}")
        if in_indices.ndim == 0:
            raise ValueError("in_indices must have shape (..., seq), got a 0-d tensor")
        seq = in_indices.shape[-1]
        if seq == 0:
            raise ValueError(f"in_indices must hold at least one token, got shape {tuple(in_indices.shape)}")
        if seq > self.config.context_length:
            raise ValueError(
                f"in_indices has {seq} tokens but the model's context_length is {self.config.context_length}"
            )
        x = self.token_embeddings(in_indices)
        for layer in self.layers:
            x = layer(x, token_positions)
        return self.lm_head(self.ln_final(x))
