"""Sliding-window evaluation (``EvalBatches(score_once=True)``, ``tlm eval --stride``): every token after the first
is scored once, equal to a brute-force loop that scores each token alone from its history."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tlm_model import ModelConfig, TransformerLM
from tlm_train import EvalBatches, evaluate

CONTEXT = 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=40, context_length=CONTEXT, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    return TransformerLM(config, dtype=torch.float64).eval()


def brute_force(model, tokens, stride):
    """Each token p >= 1 scored once, from the tokens before it in the window that reaches it first: windows
    start at 0, stride, 2·stride, ... while they fit, then one ends at the last token."""
    n = len(tokens)
    starts = list(range(0, n - CONTEXT, stride))
    if starts[-1] + CONTEXT < n - 1:
        starts.append(n - 1 - CONTEXT)
    nats, scored, histories = 0.0, set(), []
    for start in starts:
        for p in range(start + 1, start + CONTEXT + 1):
            if p in scored:
                continue
            history = torch.tensor(tokens[start:p])[None]
            with torch.no_grad():
                log_probs = F.log_softmax(model(history)[0, -1].double(), -1)
            nats -= float(log_probs[tokens[p]])
            scored.add(p)
            histories.append(p - start)
    assert scored == set(range(1, n))
    return nats, histories


@pytest.mark.parametrize(("n", "stride"), [(30, 3), (29, 8), (27, 5), (9, 1)])
def test_sliding_windows_equal_the_brute_force_reference(model, n, stride):
    tokens = np.random.default_rng(n).integers(0, 40, n)
    result = evaluate(model, EvalBatches(tokens, 3, CONTEXT, stride=stride, score_once=True))
    nats, histories = brute_force(model, tokens.tolist(), stride)
    assert result.tokens == n - 1  # every token but the first, once: the tail included
    assert result.nats == pytest.approx(nats, rel=1e-9)
    # Past the first window each token has at least context - stride tokens of history.
    assert min(histories[CONTEXT:], default=CONTEXT) >= CONTEXT - stride + 1


def test_non_overlapping_windows_score_the_tail_too(model):
    tokens = np.random.default_rng(1).integers(0, 40, 30)
    plain = evaluate(model, EvalBatches(tokens, 4, CONTEXT))  # training's validation windows: no tail
    once = evaluate(model, EvalBatches(tokens, 4, CONTEXT, score_once=True))
    assert plain.tokens == 3 * CONTEXT and once.tokens == 29
    assert math.isclose(once.nats, brute_force(model, tokens.tolist(), CONTEXT)[0], rel_tol=1e-9)


def test_a_stride_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="stride must be at most context_length=8"):
        EvalBatches(np.arange(20), 2, CONTEXT, stride=9, score_once=True)
