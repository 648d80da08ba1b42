"""evaluate against F.cross_entropy over the same fixed windows; forward passes only; bits per byte."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tlm_model import ModelConfig, TransformerLM
from tlm_train import EvalBatches, LanguageModelLoss, evaluate


def _model():
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(50, 16, 32, 1, 2, 64)).train()


@pytest.mark.parametrize("wrapped", [False, True], ids=["model", "LanguageModelLoss"])
def test_matches_token_weighted_torch_loss(record_error, wrapped):
    model = _model()
    data = np.random.default_rng(0).integers(0, 50, size=300)
    batches = EvalBatches(data, 4, 16)  # 18 windows: batches of 4, 4, 4, 4, 2
    with torch.no_grad():
        xs = torch.cat([x for x, _ in batches])
        ys = torch.cat([y for _, y in batches])
        expected = F.cross_entropy(model(xs).flatten(0, 1).double(), ys.flatten(), reduction="sum")
    result = evaluate(LanguageModelLoss(model) if wrapped else model, batches)
    assert model.training  # the mode is restored
    record_error("evaluate vs F.cross_entropy over all windows", torch.tensor(result.nats), expected)
    assert result.tokens == ys.numel() == 18 * 16
    assert result.nats == pytest.approx(expected.item(), rel=1e-6)
    assert result.loss == pytest.approx(expected.item() / ys.numel(), rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(result.loss))


class _GivenLosses(torch.nn.Module):
    """A loss module returning the next of ``losses`` (float32 scalars) for each batch."""

    def __init__(self, losses):
        super().__init__()
        self.losses = iter(losses)

    def forward(self, inputs, targets):
        return next(self.losses)


def test_sums_the_losses_in_float64():
    # 2,000 float32 batch losses of about 3 nats: summed in float32 the total drifts by ~1e-5 relative;
    # the sum of their exact float64 values (math.fsum) is the reference.
    losses = (3 + torch.rand(2000, generator=torch.Generator().manual_seed(0))).to(torch.float32)
    tokens = torch.zeros(1, 7, dtype=torch.long)
    result = evaluate(_GivenLosses(losses), [(tokens, tokens)] * len(losses))
    expected = math.fsum(float(loss) * 7 for loss in losses)
    assert result.tokens == 7 * 2000
    assert result.nats == pytest.approx(expected, rel=1e-12)
    assert result.loss == pytest.approx(expected / (7 * 2000), rel=1e-12)


def test_no_gradient_is_computed_or_kept():
    model = _model()
    data = np.random.default_rng(1).integers(0, 50, size=100)
    evaluate(model, EvalBatches(data, 2, 16))
    assert all(p.grad is None for p in model.parameters())
    assert torch.is_grad_enabled()  # no_grad ends with the call


def test_bits_per_byte_divide_the_nats_by_the_bytes_the_targets_stand_for():
    model = _model()
    data = np.random.default_rng(2).integers(0, 50, size=80)
    token_bytes = torch.arange(50) % 4  # token i stands for i % 4 bytes (0 for "special" ones)
    batches = EvalBatches(data, 3, 16)
    result = evaluate(model, batches, token_bytes=token_bytes)
    targets = torch.cat([y for _, y in batches])
    assert result.bytes == int((targets % 4).sum())
    assert result.bits_per_byte == pytest.approx(result.nats / math.log(2) / result.bytes)
    assert evaluate(model, batches).bits_per_byte is None
    assert set(result.to_dict()) == {"tokens", "loss", "perplexity", "bits_per_byte", "bytes"}


def test_targets_the_loss_skips_count_for_no_tokens_nats_or_bytes():
    # A chat prompt's targets are -100, which F.cross_entropy skips by default: they stand for no bytes either.
    model = _model()
    generator = torch.Generator().manual_seed(3)
    inputs, targets = (
        torch.randint(0, 50, (2, 16), generator=generator),
        torch.randint(0, 50, (2, 16), generator=generator),
    )
    targets[0, :5], targets[1, 10:] = -100, -100
    token_bytes = torch.arange(50) % 4 + 1
    result = evaluate(model, [(inputs, targets)], token_bytes=token_bytes)
    kept = targets != -100
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs).flatten(0, 1).double(), targets.flatten(), reduction="sum")
    assert result.tokens == int(kept.sum()) == 21
    assert result.nats == pytest.approx(expected.item(), rel=1e-6)
    assert result.bytes == int(token_bytes[targets[kept]].sum())


def test_refuses_empty_and_non_module():
    with pytest.raises(ValueError, match="at least one"):
        evaluate(_model(), [])
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        evaluate("model", [])


class _RecordsItsMode(torch.nn.Module):
    """A loss module (with a child, as a model has) that records ``training`` at each forward, or fails."""

    def __init__(self, fail=False):
        super().__init__()
        self.child = torch.nn.Linear(1, 1)
        self.seen: list[tuple[bool, bool]] = []
        self.fail = fail

    def forward(self, inputs, targets):
        self.seen.append((self.training, self.child.training))
        if self.fail:
            raise RuntimeError("out of memory")
        return torch.tensor(1.0)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_runs_in_eval_mode_and_puts_back_the_mode_it_found(training, fail):
    module = _RecordsItsMode(fail).train(training)
    tokens = torch.zeros(1, 3, dtype=torch.long)
    if fail:
        with pytest.raises(RuntimeError, match="out of memory"):
            evaluate(module, [(tokens, tokens)] * 2)
    else:
        evaluate(module, [(tokens, tokens)] * 2)
    assert module.seen == [(False, False)] * (1 if fail else 2)  # every forward in eval mode, children too
    assert (module.training, module.child.training) == (training, training)
