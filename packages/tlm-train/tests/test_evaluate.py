"""evaluate against F.cross_entropy over the same fixed windows."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tlm_model import TransformerLM
from tlm_train import EvalBatches, evaluate


def test_matches_token_weighted_torch_loss(record_error):
    model = TransformerLM(
        ModelConfig(vocab_size=50, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    ).train()
    data = np.random.default_rng(0).integers(0, 50, size=300)
    batches = EvalBatches(data, 4, 16)  # 18 windows: batches of 4, 4, 4, 4, 2
    with torch.no_grad():
        xs = torch.cat([x for x, _ in batches])
        ys = torch.cat([y for _, y in batches])
        expected = F.cross_entropy(model(xs).flatten(0, 1).double(), ys.flatten())
    ours = evaluate(model, batches)
    assert model.training
    record_error("evaluate vs F.cross_entropy over all windows", torch.tensor(ours), expected)
    assert ours == pytest.approx(expected.item(), rel=1e-5)


def test_refuses_empty_and_non_module():
    with pytest.raises(ValueError, match="at least one batch"):
        evaluate(torch.nn.Linear(2, 2), [])
    with pytest.raises(TypeError, match="model"):
        evaluate("model", [])
