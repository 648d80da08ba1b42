"""A run saved and resumed mid-way ends bit-identical to the uninterrupted run."""

import random

import numpy as np
import torch
import torch.nn.functional as F

from tlm_model import ModelConfig, TransformerLM, cross_entropy
from tlm_optim import AdamW, CosineSchedule, clip_grad_norm_
from tlm_train import BatchSampler, load_checkpoint, read_checkpoint, rng_state, save_checkpoint, set_rng_state

STEPS, SAVE_AT = 12, 5
DATA = np.random.default_rng(0).integers(0, 64, size=2000).astype(np.uint16)


def _parts(seed):
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64))
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = CosineSchedule(opt, 3e-3, 3e-4, 3, STEPS)
    sampler = BatchSampler(DATA, 4, 16, seed=seed)
    return model, opt, sched, sampler


def _step(model, opt, sched, sampler):
    x, y = next(sampler)
    # Dropout, numpy and Python draws: a resume that lost any RNG state would diverge.
    logits = F.dropout(model(x), p=0.1, training=True)
    noise = 1 + 0.01 * np.random.rand() + 0.01 * random.random()  # noqa: NPY002
    loss = cross_entropy(logits, y) * noise
    opt.zero_grad()
    loss.backward()
    clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    sched.step()


def _seed_globals(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)  # noqa: NPY002
    random.seed(seed)


def test_resume_is_bit_exact(tmp_path):
    model, opt, sched, sampler = _parts(0)
    _seed_globals(1)
    for _ in range(STEPS):
        _step(model, opt, sched, sampler)

    first = _parts(0)
    _seed_globals(1)
    for _ in range(SAVE_AT):
        _step(*first)
    m, o, s, b = first
    path = tmp_path / "run.pt"
    save_checkpoint(m, o, SAVE_AT, path, rng=rng_state(), scheduler=s.state_dict(), sampler=b.state_dict())
    del first, m, o, s, b

    _seed_globals(99)  # a fresh process: every RNG elsewhere
    resumed = _parts(7)  # different initial weights and sampler seed, all overwritten by the load
    m, o, s, b = resumed
    assert load_checkpoint(path, m, o) == SAVE_AT
    extra = read_checkpoint(path)["extra"]
    s.load_state_dict(extra["scheduler"])
    b.load_state_dict(extra["sampler"])
    set_rng_state(extra["rng"])
    for _ in range(STEPS - SAVE_AT):
        _step(*resumed)

    for (name, a), (_, c) in zip(model.state_dict().items(), m.state_dict().items(), strict=True):
        assert torch.equal(a, c), name
    assert o.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), m.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], o.state[q]["exp_avg_sq"])
