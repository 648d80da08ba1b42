"""``DecodeBatch``: rows that join and leave between steps each decode as their prompt alone with ``generate``
(greedy, and sampled with a generator of their own), which itself equals a cache-free argmax loop."""

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM, generate, sample_next_token
from tlm_model.batching import DecodeBatch

CFG = ModelConfig(vocab_size=61, context_length=48, d_model=32, num_layers=2, num_heads=4, d_ff=64)


def _drive(model, requests, max_batch_size):
    """Schedule ``requests`` (arrival step, prompt, new tokens, temperature, seed) through one DecodeBatch:
    each step, waiting requests join while there is room, every row samples, finished rows leave, and the
    rest take one batched forward."""
    batch = DecodeBatch(model, max_batch_size)
    rows, logits, outputs = [], [], {i: [] for i in range(len(requests))}  # row r: request rows[r], logits[r]
    waiting = sorted(range(len(requests)), key=lambda i: requests[i][0])
    step = 0
    while waiting or rows:
        while waiting and requests[waiting[0]][0] <= step and len(rows) < max_batch_size:
            i = waiting.pop(0)
            seed = requests[i][4]
            rows.append((i, None if seed is None else torch.Generator().manual_seed(seed)))
            logits.append(batch.add(requests[i][1]))
        step += 1
        tokens = []
        for r, (i, generator) in enumerate(rows):
            tokens.append(sample_next_token(logits[r], temperature=requests[i][3], generator=generator))
            outputs[i].append(int(tokens[-1]))
        for r in reversed(range(len(rows))):
            if len(outputs[rows[r][0]]) == requests[rows[r][0]][2]:
                moved = batch.remove(r)  # the last row takes its place
                assert moved == (None if r == len(rows) - 1 else len(rows) - 1)
                for items in (rows, tokens):
                    items[r] = items[-1]
                    items.pop()
        logits = list(batch.step(torch.stack(tokens)).unbind(0)) if rows else []
        assert batch.lengths == tuple(len(requests[i][1]) + len(outputs[i]) for i, _ in rows)
    return outputs


def test_rows_joining_and_leaving_decode_each_as_alone():
    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    gen = torch.Generator().manual_seed(1)
    requests = [(arrival, torch.randint(0, CFG.vocab_size, (n,), generator=gen), new, temperature, seed)
                for arrival, n, new, temperature, seed in [
                    (0, 5, 12, 0.0, None), (0, 17, 4, 1.0, 7), (2, 1, 20, 0.0, None), (3, 30, 9, 0.8, 11),
                    (3, 9, 15, 0.0, None), (9, 2, 6, 1.0, 7)]]  # fmt: skip
    outputs = _drive(model, requests, max_batch_size=3)  # more requests than rows: some wait for a free row
    for i, (_, prompt, new, temperature, seed) in enumerate(requests):
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        alone = generate(model, prompt, new, temperature=temperature, generator=generator)
        assert outputs[i] == alone[len(prompt) :].tolist(), i


def test_a_full_batch_and_bad_prompts_are_refused():
    model = TransformerLM(CFG).eval()
    batch = DecodeBatch(model, 1)
    with pytest.raises(ValueError, match=r"prompt_ids must be a tensor of shape \(prompt,\) with 1 to 48 ids"):
        batch.add(torch.zeros(49, dtype=torch.long))
    with pytest.raises(ValueError, match=r"prompt_ids must be a tensor of shape \(prompt,\)"):
        batch.add(torch.zeros(1, 3, dtype=torch.long))
    batch.add(torch.tensor([1, 2]))
    assert len(batch) == 1 and batch.lengths == (2,)
    with pytest.raises(ValueError, match="the batch has room for 1 rows, all in use"):
        batch.add(torch.tensor([1]))
    with pytest.raises(ValueError, match=r"row must be in \[0, 0\], got 1"):
        batch.remove(1)
    assert batch.remove(0) is None and len(batch) == 0


def test_every_position_gives_the_prompts_logits_from_the_same_prefill():
    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    prompt = torch.randint(0, CFG.vocab_size, (9,), generator=torch.Generator().manual_seed(2))
    scored, plain = DecodeBatch(model, 2), DecodeBatch(model, 2)
    every = scored.add(prompt, every_position=True)
    with torch.no_grad():
        torch.testing.assert_close(every, model(prompt.unsqueeze(0))[0], rtol=0, atol=1e-5)  # cache-free reference
    torch.testing.assert_close(every[-1], plain.add(prompt), rtol=0, atol=0)
    token = torch.tensor([3])
    torch.testing.assert_close(scored.step(token), plain.step(token), rtol=0, atol=0)  # the same row was cached
