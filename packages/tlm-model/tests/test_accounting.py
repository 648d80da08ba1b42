import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tlm_model import PRESETS, ModelConfig, TransformerLM
from tlm_model.accounting import COMPONENTS, account, compare_text, count_parameters, human


def closed_form_forward_flops(cfg: ModelConfig, batch: int, seq: int) -> int:
    """The course's (full QKᵀ) count, written out: per layer 4 d×d projections, QKᵀ and AV over seq², three
    d×d_ff FFN matrices (two for the SiLU FFN); then the LM head."""
    d, t = cfg.d_model, seq
    ffn_matrices = 2 if cfg.ffn == "silu" else 3
    per_layer = 4 * 2 * t * d * d + 2 * 2 * t * t * d + ffn_matrices * 2 * t * d * cfg.d_ff
    return batch * (cfg.num_layers * per_layer + 2 * t * d * cfg.vocab_size)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameters_equal_numel_of_the_built_model(name):
    cfg = PRESETS[name]
    model = TransformerLM(cfg, device="meta")
    report = account(cfg)
    assert report.params_total == sum(p.numel() for p in model.parameters())
    # The state dict has the course layout whether or not q/k/v and w1/w3 are fused.
    by_name = {k: v.numel() for k, v in TransformerLM(cfg, device="meta", fused=False).named_parameters()}
    for component, suffix in [
        ("attn_q_proj", "attn.q_proj.weight"),
        ("ffn_w2", "ffn.w2.weight"),
        ("ln1", "ln1.weight"),
    ]:
        assert report.params[component] == sum(v for k, v in by_name.items() if k.endswith(suffix))
    assert report.params["token_embeddings"] == by_name["token_embeddings.weight"]
    assert report.params["lm_head"] == by_name["lm_head.weight"]
    assert report.params["ln_final"] == by_name["ln_final.weight"]


@pytest.mark.parametrize(
    "cfg, batch, seq",
    [
        (ModelConfig(vocab_size=97, context_length=24, d_model=32, num_layers=3, num_heads=4, d_ff=80), 2, 24),
        (ModelConfig(vocab_size=50, context_length=40, d_model=48, num_layers=2, num_heads=6, d_ff=128), 1, 17),
        (ModelConfig(vocab_size=10, context_length=8, d_model=16, num_layers=1, num_heads=1, d_ff=16), 3, 2),
    ],
)
def test_forward_flops_equal_flop_counter_mode(cfg, batch, seq):
    model = TransformerLM(cfg, attention_backend="reference")
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    report = account(cfg, batch_size=batch, seq_len=seq)
    # Linear layers reach aten.mm; the per-head QKᵀ and attention·V einsums reach aten.bmm.
    # FlopCounterMode sees nothing else: indexing, softmax and norms are not matmuls.
    assert set(counts) == {"aten.mm", "aten.bmm"}
    flops = report.component_flops
    assert counts["aten.bmm"] == flops["attn_scores"] + flops["attn_values"]
    assert counts["aten.mm"] == report.forward_flops - counts["aten.bmm"]
    assert counter.get_total_flops() == report.forward_flops == closed_form_forward_flops(cfg, batch, seq)


def test_gpt2_xl_totals():
    cfg = PRESETS["gpt2-xl"]
    report = account(cfg)
    assert report.params_total == 2_127_057_600
    assert report.param_bytes("float32") == 4 * 2_127_057_600
    assert report.param_bytes("bfloat16") == report.param_bytes("float16") == 2 * 2_127_057_600
    assert report.training_state_bytes == 16 * 2_127_057_600
    assert report.forward_flops == closed_form_forward_flops(cfg, 1, 1024)
    long = account(cfg, seq_len=16_384)
    assert long.forward_flops == closed_form_forward_flops(cfg, 1, 16_384)


@pytest.mark.parametrize("seq", [1, 2, 7, 1024])
def test_causal_count_keeps_the_lower_triangle(seq):
    cfg = PRESETS["gpt2-small"]
    report = account(cfg, seq_len=seq)
    full, causal = report.component_flops, report.component_flops_causal
    for part in ("attn_scores", "attn_values"):
        assert causal[part] * seq == full[part] * (seq + 1) // 2
    others = [c for c in COMPONENTS if c not in ("attn_scores", "attn_values")]
    assert all(causal[c] == full[c] for c in others)
    assert report.forward_flops_causal <= report.forward_flops


def test_shares_sum_to_one_and_move_with_size():
    reports = [account(PRESETS[n]) for n in ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl")]
    for report in reports:
        assert sum(report.shares().values()) == pytest.approx(1.0)
        assert sum(report.shares(causal=True).values()) == pytest.approx(1.0)
    ffn = [r.shares()["ffn"] for r in reports]
    head = [r.shares()["lm_head"] for r in reports]
    assert ffn == sorted(ffn) and head == sorted(head, reverse=True)


def test_elementwise_is_reported_apart():
    report = account(PRESETS["course-tinystories"])
    assert report.forward_flops == sum(mm.flops for mm in report.matmuls)
    assert 0 < report.elementwise_flops_total < report.forward_flops
    assert set(report.elementwise_flops) == {"softmax", "rmsnorm", "silu_gate", "rope", "residual"}


def test_training_flops():
    report = account(PRESETS["gpt2-small"], batch_size=4, seq_len=256)
    assert report.training_flops == 3 * report.forward_flops
    assert report.to_dict()["training_flops_per_token"] == 3 * report.forward_flops // (4 * 256)


def test_count_parameters_matches_account():
    cfg = PRESETS["gpt2-medium"]
    assert count_parameters(cfg) == account(cfg).params


def test_bad_arguments():
    with pytest.raises(TypeError, match="config must be a ModelConfig, got dict"):
        account({"d_model": 1})
    with pytest.raises(ValueError, match="batch_size must be positive, got 0"):
        account(PRESETS["gpt2-small"], batch_size=0)
    with pytest.raises(TypeError, match="seq_len must be an int, got float"):
        account(PRESETS["gpt2-small"], seq_len=10.0)


# Grouped-query attention, a free head_dim and tied embeddings (issue 13's configurations).
GQA_CONFIGS = [
    ModelConfig(vocab_size=97, context_length=24, d_model=48, num_layers=2, num_heads=6, d_ff=80, num_kv_heads=2),
    ModelConfig(
        vocab_size=50,
        context_length=16,
        d_model=32,
        num_layers=2,
        num_heads=4,
        d_ff=64,
        num_kv_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
    ),
    ModelConfig(vocab_size=61, context_length=16, d_model=40, num_layers=1, num_heads=2, d_ff=48, head_dim=12),
]


@pytest.mark.parametrize("cfg", GQA_CONFIGS)
def test_gqa_head_dim_and_tied_parameters_equal_numel(cfg):
    model = TransformerLM(cfg, device="meta", fused=False)
    report = account(cfg)
    # The closed form: q and output projections heads·d_head wide, k and v kv_heads·d_head, a tied head free.
    d, f, v, q, kv = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.num_heads * cfg.d_head, cfg.kv_heads * cfg.d_head
    block = 2 * q * d + 2 * kv * d + 3 * d * f + 2 * d
    assert report.params_total == v * d + cfg.num_layers * block + d + (0 if cfg.tie_word_embeddings else v * d)
    assert report.params_total == sum(p.numel() for p in model.parameters())  # a tied weight is listed once
    by_name = {k: v.numel() for k, v in model.named_parameters()}
    projections = ["q_proj", "k_proj", "v_proj", "output_proj"]
    for component, suffix in [(f"attn_{name}", f"{name}.weight") for name in projections]:
        assert report.params[component] == sum(v for k, v in by_name.items() if k.endswith(suffix))


@pytest.mark.parametrize("cfg", GQA_CONFIGS)
def test_gqa_forward_flops_equal_flop_counter_mode(cfg):
    model = TransformerLM(cfg, attention_backend="reference", fused=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids)
    assert counter.get_total_flops() == account(cfg, batch_size=2, seq_len=11).forward_flops


# The ablations of CS336 §7: norms, RoPE and the FFN's third matrix are counted as the model builds them.
ABLATIONS = [dict(norm_placement="post"), dict(norm_placement="none"), dict(positions="none"), dict(ffn="silu")]


@pytest.mark.parametrize("fields", ABLATIONS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_ablations_count_what_the_built_model_holds_and_runs(fields):
    cfg = dataclasses.replace(
        ModelConfig(vocab_size=97, context_length=24, d_model=32, num_layers=3, num_heads=4, d_ff=80), **fields
    )
    model = TransformerLM(cfg, attention_backend="reference")
    report = account(cfg, batch_size=2, seq_len=11)
    # Closed form: 4·d² attention, 3·d·d_ff SwiGLU or 2·d·d_ff SiLU, 2·d norm gains per layer; a final norm; untied.
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    norms = 0 if cfg.norm_placement == "none" else d
    block = 4 * d * d + (2 if cfg.ffn == "silu" else 3) * d * f + 2 * norms
    assert report.params_total == sum(p.numel() for p in model.parameters()) == 2 * v * d + 3 * block + norms
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, v, (2, 11)))
    assert counter.get_total_flops() == report.forward_flops == closed_form_forward_flops(cfg, 2, 11)
    estimate = report.elementwise_flops
    assert (estimate["rmsnorm"] == 0) == (cfg.norm_placement == "none")
    assert (estimate["rope"] == 0) == (cfg.positions == "none")


# The report as text (tlm accounting prints it), each number derived here apart from the report's arithmetic.


@pytest.mark.parametrize(("n", "unit", "text"), [
    (1.234e12, "", "1.234 T"), (1e3, "B", "1.000 kB"), (999, "B", "999 B"), (999.6, "", "1000"),
    (2.5e15, "FLOP", "2.500 PFLOP"), (-3e6, "F", "-3.000 MF"), (0, "", "0"),
])  # fmt: skip
def test_human_uses_decimal_prefixes_from_1000_up(n, unit, text):
    assert human(n, unit) == text


def test_the_text_report_shows_the_built_models_parameters_memory_and_flops():
    cfg, seq = PRESETS["gpt2-small"], 1024
    n = sum(p.numel() for p in TransformerLM(cfg, device="meta").parameters())
    flops = closed_form_forward_flops(cfg, 1, seq)
    lines = account(cfg, seq_len=seq).to_text("gpt2-small").splitlines()
    assert lines[0] == (
        f"gpt2-small: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads, d_ff {cfg.d_ff}, "
        f"vocab {cfg.vocab_size}; batch 1 × seq {seq}"
    )
    assert f"  {'total':<20} {n:>15,}" in lines
    assert f"  float32 {human(4 * n, 'B')}, bfloat16 {human(2 * n, 'B')}, float16 {human(2 * n, 'B')}" in lines
    assert f"  float32 training state (params + grads + AdamW m, v = 16 B/param): {human(16 * n, 'B')}" in lines
    (total,) = [line for line in lines if line.startswith(f"  {'total':<36}")]
    assert total.split()[1:3] == human(flops, "FLOP").split()
    assert lines[-1] == (
        f"Training: backward ≈ 2 × forward = {human(2 * flops, 'FLOP')}; one step ≈ {human(3 * flops, 'FLOP')} = "
        f"{human(3 * flops / seq, 'FLOP')} per token"
    )


def test_the_comparison_gives_each_report_its_own_column():
    names, seq = ("tiny", "gpt2-small"), 256
    lines = compare_text([(name, account(PRESETS[name], seq_len=seq)) for name in names]).splitlines()
    assert lines[0].split()[-2:] == list(names)
    rows = [[float(v.rstrip("%")) for v in line.removeprefix(label).split()] for label, line in
            zip(COMPONENTS.values(), lines[1 : 1 + len(COMPONENTS)], strict=True)]  # fmt: skip
    assert [sum(column) for column in zip(*rows, strict=True)] == pytest.approx([100, 100], abs=0.05)
    flops = [human(closed_form_forward_flops(PRESETS[name], 1, seq), "F") for name in names]
    assert lines[1 + len(COMPONENTS)].split()[-4:] == " ".join(flops).split()
    params = [sum(p.numel() for p in TransformerLM(PRESETS[name], device="meta").parameters()) for name in names]
    assert lines[-2].split()[1:] == [f"{params[0] / 1e6:,.1f}", "M", f"{params[1] / 1e6:,.1f}", "M"]
    assert lines[-1] == f"(batch 1 × seq {seq})"
