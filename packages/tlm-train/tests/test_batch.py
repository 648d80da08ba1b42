"""get_batch, BatchSampler and EvalBatches: values, statistics, memmaps and bad input."""

import math
import tracemalloc

import numpy as np
import pytest
import torch

from tlm_train import BatchSampler, EvalBatches, get_batch


def test_windows_and_shift():
    data = np.arange(1000, 1100)
    x, y = get_batch(data, 16, 7, "cpu")
    assert x.shape == y.shape == (16, 7) and x.dtype == y.dtype == torch.int64
    starts = x[:, 0] - 1000
    expected = torch.from_numpy(data)[starts.unsqueeze(1) + torch.arange(8)]
    assert torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])


def test_every_window_start_equally_likely():
    """Chi-square goodness of fit of the start counts to the uniform law, with a fixed seed."""
    data, context, batch, draws = np.arange(100), 7, 32, 1000
    gen = torch.Generator().manual_seed(1234)
    counts = np.zeros(len(data), dtype=np.int64)
    for _ in range(draws):
        x, _ = get_batch(data, batch, context, "cpu", generator=gen)
        np.add.at(counts, x[:, 0].numpy(), 1)
    possible = len(data) - context  # starts 0 .. 92: the last target is data[-1]
    assert counts[possible:].sum() == 0 and (counts[:possible] > 0).all()
    expected = draws * batch / possible
    chi2 = ((counts[:possible] - expected) ** 2 / expected).sum()
    # 92 degrees of freedom: mean 92, sd √184 ≈ 13.6; the 0.999 quantile is about 135.8 (Wilson-Hilferty).
    dof = possible - 1
    z = 3.09  # 0.999 quantile of the standard normal
    quantile = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < quantile, f"chi2 {chi2:.1f} >= {quantile:.1f}"


def test_seeded_generator_reproduces_the_sequence():
    data = np.arange(500)
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(5):
        xa, ya = get_batch(data, 4, 9, "cpu", generator=a)
        xb, yb = get_batch(data, 4, 9, "cpu", generator=b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_memmap_read_without_copying_the_file(tmp_path, dtype):
    n = 4_000_000  # 8 or 16 MB on disk
    path = tmp_path / "tokens.bin"
    np.memmap(path, dtype=dtype, mode="w+", shape=(n,))[:] = np.arange(n, dtype=np.int64) % 50_000
    data = np.memmap(path, dtype=dtype, mode="r")
    tracemalloc.start()  # numpy reports its allocations to tracemalloc
    try:
        x, y = get_batch(data, 8, 256, "cpu", generator=torch.Generator().manual_seed(0))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200_000, f"peak numpy allocation {peak} bytes: the file was copied"
    assert torch.equal(x, (x[:, :1] + torch.arange(256)) % 50_000)
    assert torch.equal(y[:, :-1], x[:, 1:])


def test_tensor_dataset():
    data = torch.arange(50, dtype=torch.int32)
    x, y = get_batch(data, 3, 5, "cpu")
    assert x.dtype == torch.int64 and torch.equal(y, x + 1)


def test_inputs_not_modified():
    data = np.arange(30)
    before = data.copy()
    get_batch(data, 2, 4, "cpu")
    assert np.array_equal(data, before)


def test_unavailable_device_raises_torchs_error():
    # The course's test expects torch's own error for a device that is not there.
    with pytest.raises((RuntimeError, AssertionError)):
        get_batch(np.arange(100), 2, 7, "cuda:99")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dataset": [1, 2, 3, 4]}, TypeError, "dataset must be a 1-D"),
        ({"dataset": np.arange(20.0)}, TypeError, "integer token ids"),
        ({"dataset": np.arange(20).reshape(4, 5)}, ValueError, "1-D"),
        ({"dataset": np.arange(5)}, ValueError, "more than context_length=5"),
        ({"generator": 3}, TypeError, "generator"),
    ],
)
def test_bad_input(kwargs, error, match):
    args = {"dataset": np.arange(20), "batch_size": 2, "context_length": 5, "device": "cpu", **kwargs}
    with pytest.raises(error, match=match):
        get_batch(**args)


@pytest.mark.parametrize("make", [get_batch, BatchSampler, EvalBatches])
@pytest.mark.parametrize(
    ("sizes", "error", "match"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be positive, got 0"),
        ({"batch_size": 2.0}, TypeError, "batch_size must be an int, got float"),
        ({"context_length": -1}, ValueError, "context_length must be positive, got -1"),
        ({"context_length": 5.0}, TypeError, "context_length must be an int, got float"),
    ],
)
def test_bad_sizes_are_refused_when_built(make, sizes, error, match):
    # Every reader checks its sizes on the call that builds it, not later when len() or iteration divides by them.
    args = {"batch_size": 2, "context_length": 5, **sizes}
    with pytest.raises(error, match=match):
        make(np.arange(20), args["batch_size"], args["context_length"], "cpu")


def test_sampler_state_resumes_the_batch_sequence():
    data = np.arange(1000)
    a = BatchSampler(data, 4, 8, seed=3)
    for _ in range(3):
        next(a)
    state = a.state_dict()
    expected = [next(a) for _ in range(4)]
    b = BatchSampler(data, 4, 8, seed=99)
    b.load_state_dict(state)
    assert b.batches_drawn == 3
    for (xe, ye), (xb, yb) in zip(expected, [next(b) for _ in range(4)], strict=True):
        assert torch.equal(xe, xb) and torch.equal(ye, yb)


def test_sampler_ranks_split_one_global_batch():
    data = np.arange(10_000)
    whole = next(BatchSampler(data, 6, 8, seed=5))
    parts = [next(BatchSampler(data, 3, 8, seed=5, rank=r, world_size=2)) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])


def test_sampler_bad_input():
    with pytest.raises(ValueError, match="rank"):
        BatchSampler(np.arange(100), 2, 4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="keys"):
        BatchSampler(np.arange(100), 2, 4).load_state_dict({"generator": torch.zeros(3)})


def test_eval_batches_cover_fixed_windows_in_order():
    data = np.arange(103)
    batches = EvalBatches(data, 4, 10)
    starts = torch.cat([x[:, 0] for x, _ in batches])
    assert torch.equal(starts, torch.arange(0, 93, 10))  # 10 windows; the last ends at token 100
    assert len(batches) == 3 and len(list(batches)) == 3
    again = torch.cat([x[:, 0] for x, _ in batches])
    assert torch.equal(starts, again)
    assert len(EvalBatches(data, 4, 10, max_batches=1)) == 1
    strided = torch.cat([x[:, 0] for x, _ in EvalBatches(data, 64, 10, stride=5)])
    assert torch.equal(strided, torch.arange(0, 93, 5))


def test_eval_windows_are_spread_evenly_over_the_whole_array():
    data = np.arange(1001)  # 100 non-overlapping windows of 10 (+1 target)
    starts = torch.cat([x[:, 0] for x, _ in EvalBatches(data, 3, 10, windows=8)])
    # Window i of 8 is the floor(i * 100 / 8)-th: 0, 12, 25, 37, 50, 62, 75, 87 windows in.
    assert starts.tolist() == [0, 120, 250, 370, 500, 620, 750, 870]
    assert starts.tolist() == [10 * (i * 100 // 8) for i in range(8)]  # the same, from the rule
    again = torch.cat([x[:, 0] for x, _ in EvalBatches(data, 3, 10, windows=8)])
    assert torch.equal(starts, again)  # deterministic
    # As many windows as there are (or more) is every window, in order.
    every = torch.cat([x[:, 0] for x, _ in EvalBatches(data, 64, 10, windows=500)])
    assert torch.equal(every, torch.arange(0, 991, 10))
    # The first 8 windows (max_batches) see only the array's first 8%; the spread ones reach its last eighth.
    assert int(starts.max()) > 1001 * 7 / 8 - 10
    for bad, message in [({"windows": 0}, "windows"), ({"windows": 2, "max_batches": 1}, "max_batches"),
                         ({"windows": 2, "score_once": True}, "score_once")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            EvalBatches(data, 3, 10, **bad)


def test_sampler_seeds_start_at_zero():
    # torch's Generator.manual_seed takes -1 (as 2**64 - 1): the sampler's own check is what refuses it.
    BatchSampler(np.arange(100), 2, 4, seed=0)
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        BatchSampler(np.arange(100), 2, 4, seed=-1)
