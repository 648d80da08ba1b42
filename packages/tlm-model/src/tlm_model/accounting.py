"""Analytic resource accounting for a :class:`~tlm_model.ModelConfig` (CS336 ``transformer_accounting``).

Everything here is computed from the config alone, with no model built. What each number
includes:

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
- **Training**: backward ≈ 2 × forward matmul FLOPs, so one training step ≈ 3 × forward.
"""

import dataclasses
from dataclasses import dataclass

from tlm_model.config import ModelConfig

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

    def to_dict(self) -> dict:
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


def count_parameters(config: ModelConfig) -> dict[str, int]:
    """Parameters per component, summed over layers."""
    d, layers = config.d_model, config.num_layers
    q_width, kv_width = config.num_heads * config.d_head, config.kv_heads * config.d_head
    return {
        "token_embeddings": config.vocab_size * d,
        "attn_q_proj": layers * q_width * d,
        "attn_k_proj": layers * kv_width * d,
        "attn_v_proj": layers * kv_width * d,
        "attn_output_proj": layers * d * q_width,
        "ffn_w1": layers * config.d_ff * d,
        "ffn_w2": layers * d * config.d_ff,
        "ffn_w3": layers * config.d_ff * d,
        "ln1": layers * d,
        "ln2": layers * d,
        "ln_final": d,
        # A tied head is the token embedding itself: one parameter, counted once (there).
        "lm_head": 0 if config.tie_word_embeddings else config.vocab_size * d,
    }


def forward_matmuls(config: ModelConfig, batch_size: int, seq_len: int) -> tuple[MatMul, ...]:
    """Every matrix multiply of one forward pass, as tlm's reference path computes it."""
    d, d_ff, heads, layers = config.d_model, config.d_ff, config.num_heads, config.num_layers
    tokens, dh = batch_size * seq_len, config.d_head
    q_width, kv_width = heads * dh, config.kv_heads * dh
    # Grouped-query attention: every query head still scores against (a shared) key head.
    per_head = batch_size * heads * layers
    return (
        MatMul("q_proj", "attn_qkv_proj", tokens, d, q_width, layers),
        MatMul("k_proj", "attn_qkv_proj", tokens, d, kv_width, layers),
        MatMul("v_proj", "attn_qkv_proj", tokens, d, kv_width, layers),
        MatMul("Q Kᵀ", "attn_scores", seq_len, dh, seq_len, per_head),
        MatMul("softmax(·) V", "attn_values", seq_len, seq_len, dh, per_head),
        MatMul("output_proj", "attn_output_proj", tokens, q_width, d, layers),
        MatMul("ffn.w1", "ffn", tokens, d, d_ff, layers),
        MatMul("ffn.w3", "ffn", tokens, d, d_ff, layers),
        MatMul("ffn.w2", "ffn", tokens, d_ff, d, layers),
        MatMul("lm_head", "lm_head", tokens, d, config.vocab_size, 1),
    )


def elementwise_estimate(config: ModelConfig, batch_size: int, seq_len: int) -> dict[str, int]:
    d, layers, tokens = config.d_model, config.num_layers, batch_size * seq_len
    scores = batch_size * config.num_heads * seq_len * seq_len * layers
    cost = ELEMENTWISE_COST
    return {
        "softmax": cost["softmax"] * scores,
        "rmsnorm": cost["rmsnorm"] * tokens * d * (2 * layers + 1),
        "silu_gate": cost["silu_gate"] * tokens * config.d_ff * layers,
        "rope": cost["rope"] * tokens * (config.num_heads + config.kv_heads) * config.d_head * layers,
        "residual": cost["residual"] * 2 * tokens * d * layers,
    }


def account(config: ModelConfig, batch_size: int = 1, seq_len: int | None = None) -> Accounting:
    """The accounting report for ``config``; ``seq_len`` defaults to its context length."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    seq_len = config.context_length if seq_len is None else seq_len
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
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
