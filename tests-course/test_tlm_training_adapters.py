"""tlm's own checks of the course's training adapters, against references that share no code with tlm.

Mirrors what the course's test_data.py, test_nn_utils.py, test_optimizer.py and
test_serialization.py check, with torch built-ins (F.cross_entropy, clip_grad_norm_,
torch.optim.AdamW) and the schedule's closed form as the expected values.
"""

import inspect
import io
import math
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from . import adapters

TRAINING_SIGNATURES = {
    "run_get_batch": ["dataset", "batch_size", "context_length", "device"],
    "run_cross_entropy": ["inputs", "targets"],
    "run_gradient_clipping": ["parameters", "max_l2_norm"],
    "get_adamw_cls": [],
    "run_get_lr_cosine_schedule": [
        "it", "max_learning_rate", "min_learning_rate", "warmup_iters", "cosine_cycle_iters",
    ],
    "run_save_checkpoint": ["model", "optimizer", "iteration", "out"],
    "run_load_checkpoint": ["src", "model", "optimizer"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TRAINING_SIGNATURES))
def test_training_adapter_signatures_match_the_course(name):
    assert list(inspect.signature(getattr(adapters, name)).parameters) == TRAINING_SIGNATURES[name]


def test_get_batch_like_the_course():
    dataset, context, batch, iters = np.arange(0, 100), 7, 32, 1000
    starts = Counter()
    for _ in range(iters):
        x, y = adapters.run_get_batch(dataset=dataset, batch_size=batch, context_length=context, device="cpu")
        assert x.shape == y.shape == (batch, context)
        np.testing.assert_allclose((x + 1).numpy(), y.numpy())
        starts.update(x[:, 0].tolist())
    possible = len(dataset) - context
    assert min(starts) == 0 and max(starts) == possible - 1
    expected = iters * batch / possible
    sd = math.sqrt(iters * batch * (1 / possible) * (1 - 1 / possible))
    assert all(abs(starts[s] - expected) < 5 * sd for s in range(possible))
    with pytest.raises((RuntimeError, AssertionError)):
        adapters.run_get_batch(dataset=dataset, batch_size=batch, context_length=context, device="cuda:99")


@pytest.mark.parametrize("scale", [1.0, 1000.0])
def test_cross_entropy_matches_torch(scale, record_error):
    inputs = torch.randn(8, 5) * scale
    targets = torch.randint(0, 5, (8,))
    ours = adapters.run_cross_entropy(inputs, targets)
    expected = F.cross_entropy(inputs, targets)
    record_error("run_cross_entropy vs F.cross_entropy", ours, expected)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6 * scale)


def test_gradient_clipping_matches_torch(record_error):
    tensors = [torch.randn(5, 5) for _ in range(6)]
    max_norm = 1e-2
    ours = tuple(torch.nn.Parameter(t.clone()) for t in tensors)
    theirs = tuple(torch.nn.Parameter(t.clone()) for t in tensors)
    ours[-1].requires_grad_(False)  # a parameter without a gradient, as in the course's test
    theirs[-1].requires_grad_(False)
    for params in (ours, theirs):
        torch.cat(params).sum().mul(torch.arange(1, 6.0)).sum().backward()
    adapters.run_gradient_clipping(ours, max_norm)
    torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    for a, b in zip(ours[:-1], theirs[:-1], strict=True):
        record_error("run_gradient_clipping vs torch.nn.utils.clip_grad_norm_", a.grad, b.grad)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-8)
    assert ours[-1].grad is None


def _train(optimizer_cls, steps=100):
    torch.manual_seed(42)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 1, bias=False))
    opt = optimizer_cls(model.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.rand(model[0].in_features, generator=gen)
        y = torch.tensor([x[0] + x[1] - x[2]])
        ((model(x) - y) ** 2).sum().backward()
        opt.step()
    return model.state_dict()


def test_adamw_cls_trains_like_torch_adamw(record_error):
    cls = adapters.get_adamw_cls()
    assert issubclass(cls, torch.optim.Optimizer)
    ours, theirs = _train(cls), _train(torch.optim.AdamW)
    for key in ours:
        record_error("get_adamw_cls vs torch.optim.AdamW, course's toy problem", ours[key], theirs[key])
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-4)


def test_lr_cosine_schedule_closed_form():
    a_max, a_min, warmup, cycle = 1.0, 0.1, 7, 21
    for it in range(25):
        if it < warmup:
            expected = it / warmup * a_max
        elif it <= cycle:
            expected = a_min + (a_max - a_min) * math.cos(math.pi / 2 * (it - warmup) / (cycle - warmup)) ** 2
        else:
            expected = a_min
        got = adapters.run_get_lr_cosine_schedule(
            it=it, max_learning_rate=a_max, min_learning_rate=a_min, warmup_iters=warmup, cosine_cycle_iters=cycle
        )
        assert got == pytest.approx(expected, abs=1e-12)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(100, 200), torch.nn.Linear(200, 100), torch.nn.Linear(100, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("kind", ["path", "file"])
def test_checkpoint_round_trip(tmp_path, kind):
    torch.manual_seed(0)
    model = _Net()
    opt = adapters.get_adamw_cls()(model.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(10):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(4, 100)), torch.randint(0, 10, (4,))).backward()
        opt.step()
    out = tmp_path / "checkpoint.pt" if kind == "path" else io.BytesIO()
    adapters.run_save_checkpoint(model, opt, iteration=10, out=out)
    if kind == "file":
        out.seek(0)
    fresh = _Net()
    fresh_opt = adapters.get_adamw_cls()(fresh.parameters(), lr=1e-3, weight_decay=0.01)
    assert adapters.run_load_checkpoint(src=out, model=fresh, optimizer=fresh_opt) == 10
    assert _same(model.state_dict(), fresh.state_dict())
    assert _same(opt.state_dict(), fresh_opt.state_dict())
