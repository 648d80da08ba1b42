"""The Transformer language model of CS336 §1.1 and §1.6 (Figure 1)."""

from typing import Any, cast

import torch
from jaxtyping import Float, Integer
from torch import Tensor, nn

from tlm_attention import (
    CacheStep,
    CausalMultiHeadSelfAttention,
    KVCache,
    cache_mask,
    document_positions,
    resolve_attention_backend,
)
from tlm_linear import Embedding, Linear
from tlm_model.block import TransformerBlock, build_norm, build_rope
from tlm_model.config import ModelConfig, check_config
from tlm_model.loss import chunked_cross_entropy

#: What ``torch.compile`` puts before every state-dict key of the module it wraps.
COMPILED_PREFIX = "_orig_mod."


def check_token_ids(in_indices: object, vocab_size: int) -> None:
    """Refuse what the eager model's embedding refuses (non-integer ids, ids outside ``[0, vocab_size)``),
    with one read of the ids' range: for a boundary that runs a compiled graph, whose gather would
    otherwise wrap ``-1`` round to the last row."""
    if not isinstance(in_indices, Tensor):
        raise TypeError(f"in_indices must be a torch.Tensor, got {type(in_indices).__name__}")
    if in_indices.is_floating_point() or in_indices.is_complex() or in_indices.dtype == torch.bool:
        raise TypeError(f"in_indices must be an integer tensor, got dtype {in_indices.dtype}")
    if in_indices.numel() == 0 or in_indices.device.type == "meta":
        return
    ids = in_indices.long()
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise IndexError(f"in_indices must lie in [0, vocab_size={vocab_size}), got values in [{low}, {high}]")


def _strip_compiled_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    # torch.compile wraps a model in an OptimizedModule whose state-dict keys all start with
    # "_orig_mod."; checkpoints saved from it should load into the plain model unchanged.
    # load_state_dict hands hooks its own copy of the dict, so the caller's dict is untouched.
    marked = prefix + COMPILED_PREFIX
    for key in [k for k in state_dict if k.startswith(marked)]:
        state_dict[prefix + key[len(marked) :]] = state_dict.pop(key)


def _drop_tied_head(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    # A tied head is the embedding matrix itself: saved once, under token_embeddings.weight, as HF
    # checkpoints of tied models are.
    state_dict.pop(prefix + "lm_head.weight", None)


def _restore_tied_head(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
    embedding, head = prefix + "token_embeddings.weight", prefix + "lm_head.weight"
    if embedding not in state_dict:
        return  # load_state_dict reports the missing key
    if head in state_dict and not torch.equal(state_dict[head], state_dict[embedding]):
        raise ValueError(
            f"this model ties lm_head.weight to token_embeddings.weight (tie_word_embeddings=True), but the state "
            f"dict has a different {head!r}; build the model with tie_word_embeddings=False to load it"
        )
    state_dict[head] = state_dict[embedding]


def continue_rows(
    forward_static: Any,
    in_indices: Tensor,
    kv_cache: KVCache,
    token_positions: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Every row of ``kv_cache`` continued by the (batch, seq) ``in_indices``: their logits after every token
    (batch, seq, vocab) from ``forward_static`` (the model's, or a compiled one of the same signature), then
    the cache's lengths advanced. Refused before anything runs: positions or document ids (the cache says where
    each row continues), ids that are not (rows in use, seq), a row the tokens would take past the capacity."""
    if token_positions is not None:  # positions that contradicted the rows' lengths would overwrite tokens
        raise ValueError("token_positions must be None with a kv_cache: each row continues at its own cached length "
                         "(KVCache.continuation); give positions only without a cache")  # fmt: skip
    if document_ids is not None:
        raise ValueError("document_ids is for whole packed windows; it cannot be given with kv_cache")
    if not isinstance(kv_cache, KVCache):
        raise TypeError(f"kv_cache must be a KVCache (model.new_kv_cache), got {type(kv_cache).__name__}")
    if in_indices.ndim != 2 or in_indices.shape[0] != kv_cache.batch_size:
        raise ValueError(f"with a kv_cache in_indices must have shape (rows={kv_cache.batch_size}, seq), got "
                         f"{tuple(in_indices.shape)}")  # fmt: skip
    batch, seq = in_indices.shape
    positions, slots = kv_cache.continuation(seq)
    every = torch.arange(batch * seq, device=in_indices.device)
    logits = forward_static(in_indices, positions, kv_cache, None, every, slots)
    kv_cache.advance([seq] * batch)
    return logits.view(batch, seq, -1)


class TransformerLM(nn.Module):
    """token embedding → ``num_layers`` (pre-norm) blocks → final RMSNorm → LM head.

    Built from one :class:`ModelConfig` (``TransformerLM(config)``, or ``from_preset(name)``), kept as
    ``model.config``. ``forward`` returns unnormalised next-token logits (batch, seq, vocab). All layers
    share one RoPE table sized ``context_length``. State-dict keys: ``token_embeddings.weight``,
    ``layers.{i}.<block keys>``, ``ln_final.weight``, ``lm_head.weight``; checkpoints saved from a
    ``torch.compile``d model (keys prefixed ``_orig_mod.``) load as they are. With
    ``tie_word_embeddings=True`` ``lm_head.weight`` *is* ``token_embeddings.weight`` (one
    parameter); state dicts then leave out ``lm_head.weight`` and loading restores the tie.
    The config's ``num_kv_heads`` and ``head_dim`` select grouped-query attention and the head size;
    its ``norm_placement``, ``positions`` and ``ffn`` the ablations of CS336 §7 (``norm_placement="none"``
    drops ``ln_final`` too; ``positions="none"`` leaves ``model.rope`` None).

    Build on ``device="meta"`` to get shapes and parameter counts without allocating; then
    ``to_empty(device=...)`` and ``reset_parameters()`` to materialise it.

    Speed options, none of which changes the result beyond float rounding or the state-dict
    layout: ``attention_backend`` (``"auto"``: torch's fused SDPA; ``"reference"``: tlm's own
    softmax(QKᵀ/√d)V; ``"blockwise"``: O(seq)-memory online softmax in PyTorch) and ``fused``
    (one matmul for q/k/v and one for w1/w3). ``loss`` computes the training loss without
    materialising the full logits; ``new_kv_cache`` and ``forward(..., kv_cache=...)`` decode
    incrementally (see :func:`tlm_model.generate`).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        attention_backend: str = "auto",
        fused: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_config(config, " (TransformerLM(ModelConfig(vocab_size=..., ...)), or TransformerLM.from_preset(name))")
        resolve_attention_backend(attention_backend)  # refuse an unknown name before allocating
        self.config = config
        # A tied table is also the LM head: logit_v = h·e_v with the final RMSNorm's h of norm ~sqrt(d_model),
        # so σ = 1/sqrt(d_model) gives logits of unit variance and a first loss near ln(vocab_size) (+0.5).
        # The course's σ = 1 (right for an untied lookup) would give logits of variance d_model: a first
        # loss of tens of nats. Untied, the course's rule stands (what the course's adapters test).
        embedding_std = config.d_model**-0.5 if config.tie_word_embeddings else 1.0
        self.token_embeddings = Embedding(
            config.vocab_size, config.d_model, device=device, dtype=dtype, init_std=embedding_std
        )
        self.rope = build_rope(config, device)
        self.layers = nn.ModuleList(
            TransformerBlock(
                config, rope=self.rope, attention_backend=attention_backend, fused=fused, device=device, dtype=dtype
            )
            for _ in range(config.num_layers)
        )
        self.ln_final = build_norm(config, device, dtype)
        self.lm_head = Linear(config.d_model, config.vocab_size, device=device, dtype=dtype)
        self.register_load_state_dict_pre_hook(_strip_compiled_prefix)
        if config.tie_word_embeddings:
            # (vocab, d_model) both ways: one Parameter, so an optimizer and a save see it once.
            self.lm_head.weight = self.token_embeddings.weight
            self.register_state_dict_post_hook(_drop_tied_head)
            self.register_load_state_dict_pre_hook(_restore_tied_head)

    def _apply(self, fn: Any, recurse: bool = True) -> "TransformerLM":
        # to_empty() (and .to() with torch's overwrite-on-conversion setting) replace each module's
        # Parameter separately, which would split a tied head from its embedding: tie them again.
        super()._apply(fn, recurse)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.token_embeddings.weight
        return self

    @classmethod
    def from_preset(cls, name: str, **kwargs: Any) -> "TransformerLM":
        """``TransformerLM(ModelConfig.from_preset(name), **kwargs)``."""
        return cls(ModelConfig.from_preset(name), **kwargs)

    @property
    def attention_backend(self) -> str:
        """The backend name every layer was given; an error if the layers disagree."""
        names = [attn.attention_backend for attn in self._attentions()]
        if len(set(names)) != 1:
            raise ValueError(f"the layers use different attention backends: {names}; set model.attention_backend")
        return names[0]

    @attention_backend.setter
    def attention_backend(self, name: str) -> None:
        resolve_attention_backend(name)  # refuse an unknown name before touching any layer
        for attn in self._attentions():
            attn.attention_backend = name

    def _attentions(self) -> list[CausalMultiHeadSelfAttention]:
        return [cast(TransformerBlock, layer).attn for layer in self.layers]

    def new_kv_cache(
        self, batch_size: int, capacity: int | None = None, *, dtype: torch.dtype | None = None
    ) -> KVCache:
        """An empty :class:`~tlm_attention.KVCache` for every layer, on the model's device (the weights' dtype
        unless ``dtype`` is given), of ``capacity`` slots a row (default the context)."""
        cfg = self.config
        capacity = cfg.context_length if capacity is None else capacity
        if not 0 < capacity <= cfg.context_length:
            raise ValueError(f"capacity must be in [1, context_length={cfg.context_length}], got {capacity}")
        weight = self.lm_head.weight
        dtype = weight.dtype if dtype is None else dtype
        return KVCache(batch_size, cfg.kv_heads, capacity, cfg.d_head, weight.device, dtype, layers=cfg.num_layers)

    def reset_parameters(self) -> None:
        """Re-draw every parameter with the CS336 §1.4.1 initialisation (e.g. after ``to_empty``); a tied
        embedding is drawn with σ = 1/sqrt(d_model) instead, since it is also the LM head."""
        tied = self.config.tie_word_embeddings
        for module in self.modules():
            reset = getattr(module, "reset_parameters", None)
            # A tied head keeps the embedding's initialisation rather than redrawing it as a Linear.
            if module is not self and callable(reset) and not (tied and module is self.lm_head):
                reset()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hidden_states(
        self,
        in_indices: Integer[Tensor, "... seq"],
        token_positions: Integer[Tensor, "... seq"] | None = None,
        *,
        document_ids: Integer[Tensor, "... seq"] | None = None,
    ) -> Float[Tensor, "... seq d_model"]:
        """The final-normed activations that the LM head turns into logits.

        ``document_ids`` (one per token, equal within a document: :func:`tlm_attention.document_ids` of the
        tokens and the end-of-text id) masks attention to each token's own document and, unless
        ``token_positions`` are given, restarts the positions at each document's first token: every
        document of a packed window is computed as it would be alone.

        The caller guarantees the input (ids in the vocabulary, at most ``context_length`` tokens): the
        boundaries check it (:func:`~tlm_model.generate`, the data loaders, the command), the annotations state
        the shapes, and nothing here reads a value back to the host.
        """
        if document_ids is not None and token_positions is None and self.rope is not None:
            token_positions = document_positions(document_ids)
        x = self.token_embeddings(in_indices)
        for layer in self.layers:
            x = layer(x, token_positions, document_ids=document_ids)
        return self.ln_final(x)

    def forward(
        self,
        in_indices: Integer[Tensor, "... seq"],
        token_positions: Integer[Tensor, "... seq"] | None = None,
        kv_cache: KVCache | None = None,
        *,
        document_ids: Integer[Tensor, "... seq"] | None = None,
    ) -> Float[Tensor, "... seq vocab"]:
        """Next-token logits; with ``kv_cache`` (from :meth:`new_kv_cache`) the (batch, seq) tokens continue the
        cached sequence of each row, at positions that row's length onwards: :meth:`forward_static` over
        :meth:`~tlm_attention.KVCache.continuation`, then the lengths advanced (rows of different lengths: see
        :class:`~tlm_attention.KVCache`). ``document_ids``: see :meth:`hidden_states`."""
        if kv_cache is None:
            return self.lm_head(self.hidden_states(in_indices, token_positions, document_ids=document_ids))
        return continue_rows(self.forward_static, in_indices, kv_cache, token_positions, document_ids)

    def forward_static(
        self,
        in_indices: Integer[Tensor, "batch seq"],
        positions: Integer[Tensor, "batch seq"],
        kv_cache: KVCache,
        rows: Integer[Tensor, " batch"] | None = None,
        last: Integer[Tensor, " picked"] | None = None,
        slots: Integer[Tensor, " slots"] | None = None,
    ) -> Float[Tensor, "picked vocab"]:
        """One step over the cache (what every decode and prompt forward runs, eager or compiled): the
        next-token logits of each row's last token (batch, vocab), or with ``last`` those of the tokens it
        names, as indices into the flattened (batch * seq) tokens (picked, vocab).

        Token ``t`` of row ``b`` is stored at slot ``positions[b, t]`` of buffer row ``rows[b]`` (default
        ``b``) of every layer's cache and attends to that row's slots up to it; a padding token has position
        ``capacity`` (the scratch slot). ``slots`` (``arange(n)``, every real token's position below ``n``)
        reads only the first ``n`` slots (None: every slot). Shapes follow the arguments', never what is
        stored; nothing is checked and no host state changes: the caller then calls
        :meth:`~tlm_attention.KVCache.advance`.
        """
        capacity = kv_cache.capacity
        mask = cache_mask(positions, capacity, slots)
        limit = None if slots is None else slots.shape[0]
        # A padding token's scratch position is past the RoPE table when capacity == context_length.
        rope_positions = positions.clamp(max=capacity - 1)
        x = self.token_embeddings(in_indices)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope_positions, CacheStep(kv_cache, i, positions, rows, mask, limit))
        # last: the tokens whose logits are wanted, as flat indices into the (batch * seq) tokens.
        x = x[:, -1] if last is None else x.flatten(0, 1)[last]
        return self.lm_head(self.ln_final(x))

    def loss(
        self,
        in_indices: Integer[Tensor, "... seq"],
        targets: Integer[Tensor, "... seq"],
        *,
        chunk_size: int | None = None,
        document_ids: Integer[Tensor, "... seq"] | None = None,
    ) -> Float[Tensor, ""]:
        """Mean next-token cross-entropy, equal to ``F.cross_entropy(forward(ids), targets)``.

        The LM head and the loss run ``chunk_size`` tokens at a time (None: 256 on a CPU, more on an
        accelerator, :func:`~tlm_model.loss.default_chunk_size`), so neither the full (tokens × vocab)
        float32 logits nor their gradient is ever held in memory.
        ``document_ids``: each document of a packed window alone (see :meth:`hidden_states`).
        """
        hidden = self.hidden_states(in_indices, document_ids=document_ids).flatten(0, -2)
        # A head that is not a plain Linear (a LoRA-adapted one, tlm_lora.LoRALinear) hands over the operands
        # whose product is its output, so the chunked loss still never builds the logits.
        operands = getattr(self.lm_head, "loss_operands", None)
        hidden, weight = operands(hidden) if operands is not None else (hidden, self.lm_head.weight)
        return chunked_cross_entropy(hidden, weight, targets.flatten(), chunk_size)
