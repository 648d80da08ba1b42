"""Analytic resource accounting for a :class:`~tlm_model.ModelConfig` (CS336 ``transformer_accounting``).

Shapes come from the model itself, built on the meta device (no memory, no initialisation), so a new
config field or module changes the report without an edit here. What each number includes:

- **Parameters** per component, exact: they equal ``numel()`` summed over a built model.
- **Memory**: parameters at 4 / 2 / 2 bytes (float32 / bfloat16 / float16), and float32 training
  state: parameters, gradients and AdamW's two moments (16 bytes per parameter). Activations are
  not included; they depend on batch, sequence length and checkpointing.
- **Matmul FLOPs** of one forward pass, exact for the matrix multiplies our model runs: each
  product of an m×n and an n×p matrix counts 2·m·n·p. The course's (full QKᵀ) convention is the default: QKᵀ
  and attention·V over the full seq×seq square, as tlm's reference attention path computes them.
  A *causal* count (only the i ≥ j entries a causal kernel needs: seq·(seq+1)/2 of them) is
  reported beside it.
- **Elementwise FLOPs** (softmax, RMSNorm, SiLU and gating, RoPE, residual adds) are an
  *estimate* from per-element operation counts stated in :data:`ELEMENTWISE_COST`, kept apart from
  the matmul total.
- **Ablations** (``norm_placement``, ``positions``, ``ffn``) are counted as built: no RMSNorm
  parameters or work with ``norm_placement="none"``, no RoPE work with ``positions="none"``, and two
  FFN matrices (no ``ffn_w3``, SiLU without the gate) with ``ffn="silu"``.
- **Training**: backward ≈ 2 × forward matmul FLOPs, so one training step ≈ 3 × forward.
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from tlm_core.checks import check_positive_int
from tlm_model.config import ModelConfig, check_config

if TYPE_CHECKING:
    from tlm_model.block import TransformerBlock
    from tlm_model.lm import TransformerLM

#: Bytes per element of the parameter dtypes reported.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Float32 training state per parameter: weight, gradient, AdamW first and second moment.
TRAINING_BYTES_PER_PARAM = 4 * 4

#: FLOPs per element assumed by the elementwise estimate.
ELEMENTWISE_COST = {
    # per attention score: scale, max, subtract, exp, sum, divide
    "softmax": 6,
    # per activation: square, sum, multiply by 1/rms, multiply by gain (+ the rsqrt, negligible)
    "rmsnorm": 4,
    # per hidden unit: SiLU = x·σ(x) (negate, exp, add, divide, multiply) and the gate multiply
    "silu_gate": 6,
    # per hidden unit of the ungated SiLU FFN (ffn="silu"): SiLU alone
    "silu": 5,
    # per rotated q or k element: two multiplies and one add
    "rope": 3,
    # per activation: one add per residual connection
    "residual": 1,
}

#: Components in report order, with the label used in tables.
COMPONENTS = {
    "attn_qkv_proj": "attention q/k/v projections",
    "attn_scores": "attention QKᵀ",
    "attn_values": "attention · V",
    "attn_output_proj": "attention output projection",
    "ffn": "feed-forward (SwiGLU w1, w2, w3)",
    "lm_head": "LM head",
}


@dataclass(frozen=True)
class MatMul:
    """One matrix multiply (m×n)·(n×p), performed ``count`` times in a forward pass."""

    name: str
    component: str
    m: int
    n: int
    p: int
    count: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.p * self.count

    @property
    def shapes(self) -> str:
        return f"({self.m}×{self.n}) · ({self.n}×{self.p})"


@dataclass(frozen=True)
class Accounting:
    """The full report for one config at one batch size and sequence length."""

    config: ModelConfig
    batch_size: int
    seq_len: int
    params: dict[str, int]
    matmuls: tuple[MatMul, ...]
    causal_attention_flops: dict[str, int]
    elementwise_flops: dict[str, int]

    @property
    def params_total(self) -> int:
        return sum(self.params.values())

    def param_bytes(self, dtype: str = "float32") -> int:
        return self.params_total * DTYPE_BYTES[dtype]

    @property
    def training_state_bytes(self) -> int:
        return self.params_total * TRAINING_BYTES_PER_PARAM

    @property
    def component_flops(self) -> dict[str, int]:
        totals = dict.fromkeys(COMPONENTS, 0)
        for mm in self.matmuls:
            totals[mm.component] += mm.flops
        return totals

    @property
    def component_flops_causal(self) -> dict[str, int]:
        return {**self.component_flops, **self.causal_attention_flops}

    @property
    def forward_flops(self) -> int:
        return sum(mm.flops for mm in self.matmuls)

    @property
    def forward_flops_causal(self) -> int:
        return sum(self.component_flops_causal.values())

    @property
    def elementwise_flops_total(self) -> int:
        return sum(self.elementwise_flops.values())

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def training_flops(self) -> int:
        # Backward costs about twice the forward: one matmul for the input gradient and one for
        # the weight gradient per forward matmul.
        return 3 * self.forward_flops

    def shares(self, causal: bool = False) -> dict[str, float]:
        flops = self.component_flops_causal if causal else self.component_flops
        total = sum(flops.values())
        return {name: value / total for name, value in flops.items()}

    def to_text(self, name: str = "") -> str:
        """The report as the tables ``tlm accounting --preset NAME`` prints."""
        cfg = self.config
        title = f"{name}: " if name else ""
        lines = [
            f"{title}{cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads, d_ff {cfg.d_ff}, "
            f"vocab {cfg.vocab_size}; batch {self.batch_size} × seq {self.seq_len}",
            "",
            "Parameters",
        ]
        for component, count in self.params.items():
            lines.append(f"  {component:<20} {count:>15,}  {100 * count / self.params_total:6.2f}%")
        lines.append(f"  {'total':<20} {self.params_total:>15,}")
        lines += [
            "",
            "Memory (parameters only; activations excluded)",
            "  "
            + ", ".join(
                f"{dtype} {human(self.param_bytes(dtype), 'B')}" for dtype in ("float32", "bfloat16", "float16")
            ),
            "  float32 training state (params + grads + AdamW m, v = 16 B/param): "
            + human(self.training_state_bytes, "B"),
            "",
            "Forward matmul FLOPs (2·m·n·p each)     full QKᵀ (seed)    share     causal (i ≥ j)    share",
        ]
        full, causal = self.component_flops, self.component_flops_causal
        shares, causal_shares = self.shares(), self.shares(causal=True)
        for component, label in COMPONENTS.items():
            lines.append(
                f"  {label:<36} {human(full[component], 'FLOP'):>16} {100 * shares[component]:7.2f}%  "
                f"{human(causal[component], 'FLOP'):>16} {100 * causal_shares[component]:7.2f}%"
            )
        lines.append(
            f"  {'total':<36} {human(self.forward_flops, 'FLOP'):>16}           "
            f"{human(self.forward_flops_causal, 'FLOP'):>16}"
        )
        lines += ["", "Every matrix multiply of one forward pass"]
        for mm in self.matmuls:
            lines.append(f"  {mm.name:<13} {mm.shapes:<28} × {mm.count:<6} {mm.flops:>22,} FLOP")
        lines += ["", "Elementwise work (estimate; not in the matmul totals)"]
        for part, flops in self.elementwise_flops.items():
            lines.append(f"  {part:<12} {human(flops, 'FLOP'):>16}")
        lines.append(
            f"  {'total':<12} {human(self.elementwise_flops_total, 'FLOP'):>16}  "
            f"({100 * self.elementwise_flops_total / self.forward_flops:.2f}% of the matmul FLOPs)"
        )
        lines += [
            "",
            f"Training: backward ≈ 2 × forward = {human(2 * self.forward_flops, 'FLOP')}; "
            f"one step ≈ {human(self.training_flops, 'FLOP')} = {human(self.training_flops / self.tokens, 'FLOP')} "
            f"per token",
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "params_total": self.params_total,
            "params": dict(self.params),
            "param_bytes_fp32": self.param_bytes("float32"),
            "param_bytes_bf16": self.param_bytes("bfloat16"),
            "param_bytes_fp16": self.param_bytes("float16"),
            "training_state_bytes_fp32_adamw": self.training_state_bytes,
            "forward_flops_total": self.forward_flops,
            "forward_flops_causal": self.forward_flops_causal,
            "backward_flops_estimate": 2 * self.forward_flops,
            "training_flops_per_token": self.training_flops // self.tokens,
            "components": {
                name: {
                    "label": COMPONENTS[name],
                    "forward_flops": self.component_flops[name],
                    "share": self.shares()[name],
                    "forward_flops_causal": self.component_flops_causal[name],
                    "share_causal": self.shares(causal=True)[name],
                }
                for name in COMPONENTS
            },
            "matmuls": [{**dataclasses.asdict(mm), "flops": mm.flops} for mm in self.matmuls],
            "elementwise_flops_estimate": dict(self.elementwise_flops),
            "elementwise_flops_estimate_total": self.elementwise_flops_total,
        }


def shape_model(config: ModelConfig) -> "TransformerLM":
    """``config``'s model on the meta device, unfused (one parameter per course state-dict key): every
    shape, no memory. The accounting reads shapes from it instead of re-deriving them from the config."""
    from tlm_model.lm import TransformerLM  # lm imports nothing from here; imported late for a light import

    check_config(config)
    return TransformerLM(config, fused=False, device="meta")


def _component(name: str) -> str:
    # "layers.3.attn.q_proj.weight" -> "attn_q_proj"; "token_embeddings.weight" -> "token_embeddings"; a bias
    # ("layers.3.attn.q_proj.bias", with qkv_bias) counts with its projection.
    parts = name.removesuffix(".weight").removesuffix(".bias").split(".")
    return "_".join(parts[2:] if parts[0] == "layers" else parts)


def count_parameters(config: ModelConfig) -> dict[str, int]:
    """Parameters per component, summed over layers, counted on the model itself (a tied head is the
    embedding: one parameter, counted once, there). Read off the state dict, whose keys name each
    projection's own rows (the q/k/v biases of ``qkv_bias`` are one parameter, three keys)."""
    counts = dict.fromkeys(PARAMETER_COMPONENTS, 0)
    for name, tensor in shape_model(config).state_dict().items():
        counts[_component(name)] += tensor.numel()
    return counts


#: Components of :func:`count_parameters`, in report order.
PARAMETER_COMPONENTS = (
    "token_embeddings", "attn_q_proj", "attn_k_proj", "attn_v_proj", "attn_output_proj",
    "ffn_w1", "ffn_w2", "ffn_w3", "ln1", "ln2", "ln_final", "lm_head",
)  # fmt: skip

# Which report component each weight's matmul belongs to, and its label in the matmul table.
_MATMULS = {
    "attn_q_proj": ("attn_qkv_proj", "q_proj"),
    "attn_k_proj": ("attn_qkv_proj", "k_proj"),
    "attn_v_proj": ("attn_qkv_proj", "v_proj"),
    "attn_output_proj": ("attn_output_proj", "output_proj"),
    "ffn_w1": ("ffn", "ffn.w1"),
    "ffn_w3": ("ffn", "ffn.w3"),
    "ffn_w2": ("ffn", "ffn.w2"),
    "lm_head": ("lm_head", "lm_head"),
}


def forward_matmuls(config: ModelConfig, batch_size: int, seq_len: int) -> tuple[MatMul, ...]:
    """Every matrix multiply of one forward pass, as tlm's reference path computes it: one per weight
    of the model (shapes read from its modules) and attention's two per head."""
    model = shape_model(config)
    tokens, layers = batch_size * seq_len, config.num_layers
    block = cast("TransformerBlock", model.layers[0])
    weights = {_component(f"layers.0.{name}"): w for name, w in block.named_parameters() if w.ndim == 2}
    # The LM head is the embedding matrix when tied: the matmul happens either way.
    weights["lm_head"] = model.lm_head.weight
    attention = block.attn
    # Grouped-query attention: every query head still scores against (a shared) key head.
    per_head, d_head = batch_size * int(attention.num_heads) * layers, int(attention.d_head)
    out = []
    for component, (group, label) in _MATMULS.items():
        if component not in weights:  # ffn_w3 of the two-matrix SiLU FFN
            continue
        rows, cols = (int(n) for n in weights[component].shape)  # (out_features, in_features)
        out.append(MatMul(label, group, tokens, cols, rows, 1 if component == "lm_head" else layers))
        if component == "attn_v_proj":
            out.append(MatMul("Q Kᵀ", "attn_scores", seq_len, d_head, seq_len, per_head))
            out.append(MatMul("softmax(·) V", "attn_values", seq_len, seq_len, d_head, per_head))
    return tuple(out)


def elementwise_estimate(config: ModelConfig, batch_size: int, seq_len: int) -> dict[str, int]:
    d, layers, tokens = config.d_model, config.num_layers, batch_size * seq_len
    scores = batch_size * config.num_heads * seq_len * seq_len * layers
    cost = ELEMENTWISE_COST
    norms = 0 if config.norm_placement == "none" else 2 * layers + 1  # pre and post: two per block and the final
    rotated = 0 if config.positions == "none" else (config.num_heads + config.kv_heads) * config.d_head
    return {
        "softmax": cost["softmax"] * scores,
        "rmsnorm": cost["rmsnorm"] * tokens * d * norms,
        "silu_gate": cost["silu_gate" if config.ffn == "swiglu" else "silu"] * tokens * config.d_ff * layers,
        "rope": cost["rope"] * tokens * rotated * layers,
        "residual": cost["residual"] * 2 * tokens * d * layers,
    }


def account(config: ModelConfig, batch_size: int = 1, seq_len: int | None = None) -> Accounting:
    """The accounting report for ``config``; ``seq_len`` defaults to its context length."""
    check_config(config)
    seq_len = config.context_length if seq_len is None else seq_len
    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len)
    # A causal kernel needs only the seq·(seq+1)/2 query-key pairs with key ≤ query.
    pairs = seq_len * (seq_len + 1) // 2
    causal = 2 * pairs * config.d_head * batch_size * config.num_heads * config.num_layers
    return Accounting(
        config=config,
        batch_size=batch_size,
        seq_len=seq_len,
        params=count_parameters(config),
        matmuls=forward_matmuls(config, batch_size, seq_len),
        causal_attention_flops={"attn_scores": causal, "attn_values": causal},
        elementwise_flops=elementwise_estimate(config, batch_size, seq_len),
    )


def human(n: float, unit: str = "") -> str:
    """1.234e12 -> '1.234 T' + unit (decimal prefixes)."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.3f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def compare_text(reports: Sequence[tuple[str, Accounting]]) -> str:
    """Each component's share of forward FLOPs, one column per (name, report): ``tlm accounting --compare``."""
    width = max(14, *(len(name) + 2 for name, _ in reports))
    header = f"{'share of forward FLOPs':<36}" + "".join(f"{name:>{width}}" for name, _ in reports)
    lines = [header]
    for component, label in COMPONENTS.items():
        lines.append(f"{label:<36}" + "".join(f"{100 * r.shares()[component]:>{width - 1}.2f}%" for _, r in reports))
    lines.append(
        f"{'forward FLOPs (full QKᵀ)':<36}" + "".join(f"{human(r.forward_flops, 'F'):>{width}}" for _, r in reports)
    )
    lines.append(
        f"{'forward FLOPs (causal)':<36}"
        + "".join(f"{human(r.forward_flops_causal, 'F'):>{width}}" for _, r in reports)
    )
    lines.append(f"{'parameters':<36}" + "".join(f"{r.params_total / 1e6:>{width - 2},.1f} M" for _, r in reports))
    seqs = sorted({r.seq_len for _, r in reports})
    lines.append(f"(batch {reports[0][1].batch_size} × seq {', '.join(map(str, seqs))})")
    return "\n".join(lines)
