"""Model hyperparameters as data, with the named presets of CS336 assignment 1."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tlm_attention.heads import head_layout
from tlm_core.checks import check_bool, check_choice, check_number, check_positive_int, rephrased
from tlm_ffn.options import FFN_KINDS
from tlm_rope.options import LAYOUTS, RULE_NAMES, check_scaling

#: Upper bounds on the sizes a config may claim: each is many times what any released model uses
#: (Llama 3.1 405B: 126 layers, d_model 16,384, d_ff 53,248, 128K context), and together they keep a
#: lying config.json or checkpoint header from asking for terabytes (RoPE tables are sized by
#: context_length) before the file's own tensors are checked against it.
LIMITS = {
    "vocab_size": 1 << 24,
    "context_length": 1 << 20,
    "d_model": 1 << 18,
    "num_layers": 1 << 10,
    "num_heads": 1 << 12,
    "d_ff": 1 << 20,
    "num_kv_heads": 1 << 12,
    "head_dim": 1 << 12,
}

#: Where a block's RMSNorms sit: before each sublayer (the course's), after each residual add, or nowhere.
NORM_PLACEMENTS = ("pre", "post", "none")
#: How attention sees positions: RoPE, or nothing but the causal mask (NoPE).
POSITIONS = ("rope", "none")


def _choice(default: str, choices: tuple[str, ...], help: str) -> Any:
    """A field that names one of ``choices``: its default, the choices (which the checks and ``--help``
    read) and its help, declared once."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to build a :class:`~tlm_model.TransformerLM`.

    Field names follow the course's ``run_transformer_lm`` adapter; the Llama-family fields default
    to the course model. Each field says what it is in its metadata: ``help``, ``choices`` for a
    name, and ``shown``, what a default of None means; ``tlm train --help`` shows these, and the
    checks below read ``choices``. ``norm_eps`` follows CS336 §1.5.1 (1e-5); a tied head is one
    parameter, as in Press & Wolf 2017 and SmolLM2/Llama-3.2-1B; ``rope_scaling`` takes HF's
    ``rope_parameters`` keys and ``rope_layout`` is :class:`tlm_rope.RotaryPositionalEmbedding`'s
    ``layout``.

    Three fields select the ablations of CS336 §7 (each default is the course model):

    - ``norm_placement``: ``"pre"`` (x + sublayer(norm(x)), then a final norm), ``"post"``
      (norm(x + sublayer(x)), the original Transformer's; the final norm stays) or ``"none"`` (no RMSNorm
      anywhere, the final one included: the model has no norm weights);
    - ``positions``: ``"rope"`` or ``"none"`` (NoPE: causal attention with no positional signal; the
      ``rope_*`` fields then go unused, and ``rope_scaling`` must stay None);
    - ``ffn``: ``"swiglu"`` (w2(silu(w1 x) ⊙ w3 x), 3·d_model·d_ff parameters) or ``"silu"`` (w2 silu(w1 x),
      2·d_model·d_ff). ``d_ff`` is given either way; the course's widths, which give both about
      8·d_model² parameters, are ``tlm_ffn.default_d_ff(d_model, kind=ffn)``: 8/3·d_model rounded up to
      64, and 4·d_model. ``tlm train`` takes that width when its ``[model]`` table changes ``ffn`` from
      the preset's without a ``d_ff``.

    Only the defaults are a Llama: :func:`tlm_model.save_hf` refuses the others.
    """

    vocab_size: int = field(metadata={"help": "token ids the model embeds and predicts"})
    context_length: int = field(metadata={"help": "the longest sequence the model reads (the training window)"})
    d_model: int = field(metadata={"help": "width of the residual stream"})
    num_layers: int = field(metadata={"help": "Transformer blocks"})
    num_heads: int = field(metadata={"help": "query heads"})
    d_ff: int = field(metadata={"help": "FFN hidden width"})
    rope_theta: float = field(default=10_000.0, metadata={"help": "RoPE base Θ"})
    norm_eps: float = field(default=1e-5, metadata={"help": "RMSNorm epsilon"})
    num_kv_heads: int | None = field(
        default=None,
        metadata={"help": "key/value heads (fewer than num_heads: grouped-query attention)", "shown": "num_heads"},
    )
    head_dim: int | None = field(default=None, metadata={"help": "per-head width", "shown": "d_model / num_heads"})
    tie_word_embeddings: bool = field(default=False, metadata={"help": "the LM head reuses the token embedding matrix"})
    qkv_bias: bool = field(
        default=False, metadata={"help": "the q, k and v projections add a learned bias (Qwen2's attention)"}
    )
    rope_scaling: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": 'RoPE context extension, e.g. {"rope_type": "linear", "factor": 2.0}; with --init-from and a '
            "longer --context-length, a rule's name (its factor: the new context over the old, or --rope-factor)",
            "names": RULE_NAMES,
        },
    )
    rope_layout: str = _choice(
        "interleaved", LAYOUTS, "RoPE pairing: interleaved (the course's) or half (HF's rotate-half)"
    )
    norm_placement: str = _choice(
        "pre",
        NORM_PLACEMENTS,
        "where RMSNorm goes: pre (the course's), post (norm(x + sublayer(x))) or none (nowhere, the final norm "
        "included)",
    )
    positions: str = _choice("rope", POSITIONS, "rope, or none (NoPE: only the causal mask carries position)")
    ffn: str = _choice(
        "swiglu",
        FFN_KINDS,
        "swiglu (W2(SiLU(W1·x) ⊙ W3·x)) or silu (W2·SiLU(W1·x)); changing the kind without --d-ff sizes d_ff as the "
        "course does (silu: 4·d_model; swiglu: 8/3·d_model, rounded up to 64)",
    )

    def __post_init__(self) -> None:
        # Field types and ranges first: the cross-field rules below need them, and a config read
        # from config.json or built for accounting is checked before any module exists.
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            check_positive_int(f"ModelConfig.{name}", getattr(self, name))
            _check_limit(name, getattr(self, name))
        check_number("ModelConfig.rope_theta", self.rope_theta, low=0.0, low_open=True)
        check_number("ModelConfig.norm_eps", self.norm_eps, low=0.0)
        for name in ("num_kv_heads", "head_dim"):
            if getattr(self, name) is not None:
                check_positive_int(f"ModelConfig.{name}", getattr(self, name))
                _check_limit(name, getattr(self, name))
        check_bool("ModelConfig.tie_word_embeddings", self.tie_word_embeddings)
        check_bool("ModelConfig.qkv_bias", self.qkv_bias)
        try:
            # A private copy: the caller's dict may change later, a frozen config must not.
            object.__setattr__(self, "rope_scaling", check_scaling(self.rope_scaling))
        except (TypeError, ValueError) as err:
            raise rephrased(err, f"ModelConfig.rope_scaling: {err}") from None
        for name, choices in _CHOICES.items():
            check_choice(f"ModelConfig.{name}", getattr(self, name), choices)
        # The attention's own rule, under this config's names: the blocks are built from these fields.
        head_layout(self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, owner="ModelConfig.")
        if self.positions == "rope" and self.d_head % 2 != 0:
            raise ValueError(f"ModelConfig: d_model / num_heads must be even for RoPE, got {self.d_head} (or head_dim)")
        if self.positions == "none" and self.rope_scaling is not None:
            raise ValueError(
                f"ModelConfig.rope_scaling must be None with positions='none' (no RoPE to scale), "
                f"got {self.rope_scaling}"
            )

    @property
    def d_head(self) -> int:
        """The per-head dimension: ``head_dim``, or ``d_model / num_heads`` when that is None."""
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads: ``num_kv_heads``, or ``num_heads`` when that is None."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @classmethod
    def from_preset(cls, name: str) -> "ModelConfig":
        """One of :data:`PRESETS` by name, e.g. ``ModelConfig.from_preset("gpt2-xl")``."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}") from None

    def to_dict(self, *, drop_none: bool = False) -> dict[str, Any]:
        """The fields as a dict; ``drop_none`` leaves out fields at None (TOML has no null)."""
        data = dataclasses.asdict(self)
        return {k: v for k, v in data.items() if v is not None} if drop_none else data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; expected a subset of {sorted(names)}")
        return cls(**data)


FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
#: The fields whose values are names, and the names each takes (read from the field's ``choices``).
_CHOICES = {f.name: f.metadata["choices"] for f in dataclasses.fields(ModelConfig) if "choices" in f.metadata}


def check_config(config: object, hint: str = "") -> ModelConfig:
    """``config`` when it is a :class:`ModelConfig`; otherwise the TypeError every builder raises (``hint``: how
    to make one)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}{hint}")
    return config


def _check_limit(field: str, value: int) -> None:
    if value > LIMITS[field]:
        raise ValueError(f"ModelConfig.{field} must be <= {LIMITS[field]:,} (tlm's limit), got {value:,}")


def _gpt2(d_model: int, num_layers: int, num_heads: int, d_ff: int | None = None) -> ModelConfig:
    # The sizes of CS336's accounting problem: GPT-2 widths and depths with this architecture
    # (SwiGLU, RoPE, RMSNorm); d_ff = 4·d_model except where the problem states it.
    return ModelConfig(
        vocab_size=50_257,
        context_length=1_024,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        d_ff=4 * d_model if d_ff is None else d_ff,
    )


PRESETS: dict[str, ModelConfig] = {
    # The default of `tlm train`: ~1.1 M parameters, trains on a laptop CPU in minutes.
    "tiny": ModelConfig(vocab_size=1_024, context_length=128, d_model=128, num_layers=4, num_heads=4, d_ff=384),
    # The TinyStories model the course trains in assignment 1.
    "course-tinystories": ModelConfig(
        vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344
    ),
    "gpt2-small": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25, d_ff=6400),
}
