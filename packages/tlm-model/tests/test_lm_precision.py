"""TransformerLM in bfloat16, float16 and under CPU autocast, against a float64 copy of itself.

The reference is the same model built in float64 with the low-precision model's own weights
copied in (exactly: every bfloat16/float16/float32 value is a float64 value), so the error
measured is the error of computing in low precision, not of rounding the weights.

Error = max |logits - reference| / max |reference| over the whole (batch, seq, vocab) output.
Measured on exactly these configs and seeds, over every attention backend (docs/reliability.md,
"Mixed precision"): bfloat16 ≤ 8.5e-3 (2.2 u), float16 ≤ 1.1e-3 (2.3 u), autocast ≤ 7.7e-3 (2.0 u
of bfloat16), float32 ≤ 6.5e-7 (11 u), where u is the dtype's unit roundoff (eps / 2). The bounds
below, 4 u for the narrow dtypes and 32 u for float32, leave a margin of 1.7x to 3x. The run prints
the largest errors seen in its terminal summary.
"""

import pytest
import torch

from tlm_attention import BACKENDS
from tlm_model import ModelConfig, TransformerLM

CONFIGS = {
    "2-layer-d64": ModelConfig(vocab_size=97, context_length=32, d_model=64, num_layers=2, num_heads=4, d_ff=172),
    "3-layer-d128": ModelConfig(vocab_size=256, context_length=64, d_model=128, num_layers=3, num_heads=8, d_ff=344),
}


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


# mode -> (parameter dtype, autocast dtype or None, bound on max|err| / max|ref|)
MODES = {
    "bfloat16": (torch.bfloat16, None, 4 * unit_roundoff(torch.bfloat16)),  # 1.56e-2
    "float16": (torch.float16, None, 4 * unit_roundoff(torch.float16)),  # 1.95e-3
    "autocast-bfloat16": (torch.float32, torch.bfloat16, 4 * unit_roundoff(torch.bfloat16)),  # 1.56e-2
    "float32": (torch.float32, None, 32 * unit_roundoff(torch.float32)),  # 1.91e-6
}


def build(cfg, seed, dtype, backend):
    torch.manual_seed(seed)
    model = TransformerLM(cfg, attention_backend=backend)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name:  # RMSNorm gains start at 1; make them matter
                p.copy_(torch.rand_like(p) + 0.5)
    return model.to(dtype)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_logits_stay_within_bound_of_float64(mode, backend, config, seed, record_error):
    cfg = CONFIGS[config]
    param_dtype, autocast_dtype, bound = MODES[mode]
    model = build(cfg, seed, param_dtype, backend)
    # The reference: tlm's own attention with separate q/k/v projections, in float64.
    reference = TransformerLM(cfg, dtype=torch.float64, attention_backend="reference", fused=False)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), generator=torch.Generator().manual_seed(seed))

    if autocast_dtype is None:
        logits = model(ids)
        assert logits.dtype == param_dtype
    else:
        with torch.autocast("cpu", dtype=autocast_dtype):
            logits = model(ids)
        # The LM head is a matmul, which autocast runs (and returns) in bfloat16.
        assert logits.dtype == autocast_dtype
    expected = reference(ids)
    record_error(f"TransformerLM {mode} ({backend} attention) vs float64 copy", logits, expected)
    assert torch.isfinite(logits).all()
    error = ((logits.double() - expected).abs().max() / expected.abs().max()).item()
    assert error <= bound, f"max|err|/max|ref| = {error:.3e} > {bound:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_tables_stay_float32_after_model_cast(dtype):
    cfg = CONFIGS["2-layer-d64"]
    reference = TransformerLM(cfg)
    model = TransformerLM(cfg).to(dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    # One shared table, float32 and identical to a freshly built float32 model's, for every
    # position up to context_length.
    for layer in model.layers:
        assert layer.attn.rope is model.rope
    assert model.rope.cos.dtype == model.rope.sin.dtype == torch.float32
    assert model.rope.cos.shape[0] == cfg.context_length
    assert torch.equal(model.rope.cos, reference.rope.cos) and torch.equal(model.rope.sin, reference.rope.sin)
