"""Property-based tests of TransformerLM on tiny random configurations: causality and
batch-row independence.

Configurations, batch dimensions, dtypes and seeds are drawn by hypothesis; the profile (root
conftest.py) decides how many examples run: "ci" by default, ``--hypothesis-profile=thorough``.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tlm_attention import BACKENDS
from tlm_model import ModelConfig, TransformerLM

# The `device` fixture only names a device, so sharing it across examples is safe.
fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def tiny_configs(draw):
    # Valid by construction: d_model = heads · d_head with an even d_head (RoPE rotates pairs).
    heads = draw(st.integers(1, 3))
    d_head = 2 * draw(st.integers(1, 3))
    return ModelConfig(
        vocab_size=draw(st.integers(2, 40)),
        context_length=draw(st.integers(1, 10)),
        d_model=heads * d_head,
        num_layers=draw(st.integers(1, 2)),
        num_heads=heads,
        d_ff=draw(st.integers(1, 16)),
        rope_theta=draw(st.sampled_from([10.0, 10_000.0])),
    )


@st.composite
def lm_cases(draw):
    cfg = draw(tiny_configs())
    seq = draw(st.integers(1, cfg.context_length))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
    options = {"attention_backend": draw(st.sampled_from(BACKENDS)), "fused": draw(st.booleans())}
    return cfg, seq, batch, options, dtype, draw(st.integers(0, 2**32 - 1))


def build(cfg, options, dtype, seed, device):
    torch.manual_seed(seed)  # parameters are drawn from the global generator
    return TransformerLM(cfg, device=device, dtype=dtype, **options)


@fixture_ok
@given(case=lm_cases(), data=st.data())
def test_logits_at_t_ignore_tokens_after_t(case, data, device):
    cfg, seq, batch, options, dtype, seed = case
    model = build(cfg, options, dtype, seed, device)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (*batch, seq), generator=g).to(device)
    t = data.draw(st.integers(0, seq - 1), label="t")
    changed = ids.clone()
    changed[..., t + 1 :] = torch.randint(0, cfg.vocab_size, changed[..., t + 1 :].shape, generator=g).to(device)
    # Later tokens reach position t only through attention weights that are exactly 0, and every
    # kernel sees the same shapes: bitwise equality, not closeness.
    assert torch.equal(model(ids)[..., : t + 1, :], model(changed)[..., : t + 1, :])


@fixture_ok
@given(case=lm_cases(), rows=st.integers(2, 4), data=st.data())
def test_batch_row_ignores_other_rows(case, rows, data, device):
    cfg, seq, batch, options, dtype, seed = case
    model = build(cfg, options, dtype, seed, device)
    g = torch.Generator().manual_seed(seed)
    shape = (rows, *batch, seq)
    ids = torch.randint(0, cfg.vocab_size, shape, generator=g).to(device)
    b = data.draw(st.integers(0, rows - 1), label="row")
    changed = torch.randint(0, cfg.vocab_size, shape, generator=g).to(device)
    changed[b] = ids[b]
    assert torch.equal(model(ids)[b], model(changed)[b])
