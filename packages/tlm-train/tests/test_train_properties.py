"""Property-based tests (hypothesis) of the batch helpers and checkpoint round trips."""

import io

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tlm_train import EvalBatches, get_batch, read_checkpoint, save_checkpoint


@given(st.integers(2, 300), st.integers(1, 40), st.integers(1, 9), st.integers(0, 2**16))
def test_batches_are_shifted_windows_of_the_data(n, context, batch, seed):
    context = min(context, n - 1)
    data = np.random.default_rng(seed).integers(0, 60_000, size=n).astype(np.uint16)
    x, y = get_batch(data, batch, context, "cpu", generator=torch.Generator().manual_seed(seed))
    full = torch.from_numpy(data.astype(np.int64))
    for row_x, row_y in zip(x, y, strict=True):
        starts = [s for s in range(n - context) if torch.equal(full[s : s + context], row_x)]
        assert starts and any(torch.equal(full[s + 1 : s + context + 1], row_y) for s in starts)


@given(st.integers(2, 300), st.integers(1, 40), st.integers(1, 9), st.integers(1, 50))
def test_eval_windows_are_in_range_and_ordered(n, context, batch, stride):
    context = min(context, n - 1)
    starts = torch.cat([x[:, 0] for x, _ in EvalBatches(np.arange(n), batch, context, stride=stride)])
    assert starts[0] == 0 and (starts.diff() == stride).all() and starts[-1] + context < n
    assert starts[-1] + stride + context >= n  # no further window fits


leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**62), 2**62), st.floats(allow_nan=False), st.text(max_size=8)
)
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=4)),
    max_leaves=12,
)


@given(trees, st.integers(0, 10**9))
def test_extra_state_round_trips(extra, iteration):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buffer = io.BytesIO()
    save_checkpoint(model, opt, iteration, buffer, tree=extra, tensor=torch.arange(3))
    buffer.seek(0)
    loaded = read_checkpoint(buffer)
    assert loaded["step"] == iteration and loaded["extra"]["tree"] == extra
    assert torch.equal(loaded["extra"]["tensor"], torch.arange(3))
