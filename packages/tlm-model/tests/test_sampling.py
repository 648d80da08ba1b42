"""``tlm_model.sampling`` on its own: one batch of greedy and sampled rows together, each row as it would be
alone (``tlm_model.sample_next_token`` with its own settings and generator), penalties and bias by OpenAI's
definitions written out, and OpenAI's log-probabilities against ``torch.log_softmax`` in float64."""

import pytest
import torch

from tlm_model import sample_next_token
from tlm_model.sampling import RowParams, adjusted_logits, sample_rows, token_logprobs

VOCAB = 50


def params(temperature, top_p, **extra):
    return RowParams(torch.tensor(temperature), torch.tensor(top_p), torch.zeros(len(temperature)),
                     torch.zeros(len(temperature)), **extra)  # fmt: skip


@pytest.mark.parametrize("known_rows", [False, True])
def test_greedy_and_sampled_rows_in_one_batch_each_draw_as_alone(known_rows):
    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB) * 3
    # Rows 0, 2 and 4 are greedy (no generator) whatever their temperature value says; 1 and 3 sample.
    temperature, top_p = [0.9, 0.8, 1.5, 1.3, 0.7], [1.0, 0.9, 0.5, 1.0, 1.0]
    seeds = [None, 11, None, 12, None]
    for trial in range(20):  # many draws: a row that took another row's noise or settings would show
        generators = [None if s is None else torch.Generator().manual_seed(s * 100 + trial) for s in seeds]
        rows = params(temperature, top_p, sampled=torch.tensor([1, 3]) if known_rows else None)
        got = sample_rows(logits, rows, generators, any_top_p=True)
        for r in range(5):
            if seeds[r] is None:
                assert got[r] == logits[r].argmax()
            else:
                alone = sample_next_token(logits[r : r + 1], temperature=temperature[r],
                                          top_p=top_p[r] if top_p[r] < 1 else None,
                                          generator=torch.Generator().manual_seed(seeds[r] * 100 + trial))  # fmt: skip
                assert got[r] == alone[0], (trial, r)
    all_greedy = sample_rows(logits, params(temperature, top_p), [None] * 5, any_top_p=False)
    assert torch.equal(all_greedy, logits.argmax(-1))


def test_penalties_and_bias_follow_openais_definition():
    logits = torch.randn(2, VOCAB)
    counts = torch.zeros(2, VOCAB)
    counts[0, 3], counts[0, 7], counts[1, 7] = 2, 1, 5
    bias = torch.zeros(2, VOCAB)
    bias[1, 9] = -100
    rows = RowParams(torch.zeros(2), torch.ones(2), torch.tensor([0.5, 0.0]), torch.tensor([0.25, 1.5]), bias, counts)
    expected = logits.double().clone()
    for r, (presence, frequency) in enumerate([(0.5, 0.25), (0.0, 1.5)]):
        for token in range(VOCAB):
            count = counts[r, token].item()
            expected[r, token] -= count * frequency + (presence if count > 0 else 0.0)
    expected[1, 9] -= 100
    torch.testing.assert_close(adjusted_logits(logits, rows).double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("top", [0, 1, 3])
def test_logprobs_are_the_raw_logits_log_softmax(top):
    logits = torch.randn(4, VOCAB, dtype=torch.bfloat16)
    chosen = torch.tensor([0, 5, VOCAB - 1, 7])
    picked, values, ids = token_logprobs(logits, chosen, top)
    reference = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(picked.double(), reference.gather(-1, chosen[:, None])[:, 0], rtol=0, atol=1e-5)
    assert values.shape == ids.shape == (4, top)
    torch.testing.assert_close(values.double(), reference.topk(top, -1).values, rtol=0, atol=1e-5)
