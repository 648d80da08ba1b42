"""DecodeBatch's sizes and a refilled row (tlm_model.batching): the batch sizes a step may run at, the grid width
that packs prompt chunks, checked against a search over the widths the docstring names, and a row refilled with
a prompt of several tokens, checked against a cache-free forward of that prompt."""

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM
from tlm_model.batching import DecodeBatch, batch_buckets, grid_width

CFG = ModelConfig(vocab_size=61, context_length=48, d_model=32, num_layers=2, num_heads=4, d_ff=64)


@pytest.mark.parametrize(("size", "error", "message"), [
    (0, ValueError, "^max_batch_size must be positive, got 0$"),
    (-3, ValueError, "^max_batch_size must be positive, got -3$"),
    (True, TypeError, "^max_batch_size must be an int, got bool"),
])  # fmt: skip
def test_batch_buckets_refuse_a_batch_size_that_is_not_a_positive_int(size, error, message):
    with pytest.raises(error, match=message):
        batch_buckets(size)


def test_a_limit_of_two_buckets_is_one_row_and_the_largest_batch():
    # The docstring: 1, the powers of two below max_batch_size and max_batch_size itself, at most ``limit``.
    assert batch_buckets(16, limit=2) == (1, 16)
    assert batch_buckets(16, limit=3) == (1, 8, 16)
    with pytest.raises(ValueError, match="^limit must be >= 2, got 1$"):
        batch_buckets(16, limit=1)


def _fewest_cells(lengths):
    """The docstring's rule by search: among a power of two up to the longest chunk, half the longest (rounded
    up) and the longest (each at least 2), the width of the fewest cells (at least 2 rows), the widest of equals."""
    longest = max(lengths)
    candidates = {max(2, longest), max(2, (longest + 1) // 2)} | {2**k for k in range(1, 64) if 2**k <= longest}
    cells = {w: max(2, sum((n + w - 1) // w for n in lengths)) * w for w in candidates}
    fewest = min(cells.values())
    return max(w for w, c in cells.items() if c == fewest)


@pytest.mark.parametrize("lengths", [[1], [2], [4], [4, 3, 3, 3], [4, 1, 1], [5, 5], [7, 2], [12, 6, 6], [33, 1, 9]])
def test_the_grid_width_is_the_named_width_of_the_fewest_cells(lengths):
    assert grid_width(lengths) == _fewest_cells(lengths)


@torch.no_grad()
def test_a_refilled_row_gives_the_logits_after_the_last_token_of_its_new_prompt():
    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    batch = DecodeBatch(model, 2)
    batch.add(torch.tensor([1, 2, 3]))
    batch.add(torch.tensor([4, 5]))
    prompt = torch.tensor([7, 8, 9, 10, 11])
    logits = batch.refill(0, prompt)
    torch.testing.assert_close(logits, model(prompt[None])[0, -1], rtol=1e-5, atol=1e-5)
    assert batch.lengths == (5, 2)
