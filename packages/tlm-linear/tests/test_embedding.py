import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from tlm_linear import Embedding


@pytest.mark.parametrize("shape", [(), (6,), (2, 5), (2, 3, 4)])
def test_matches_f_embedding(shape, device):
    emb = Embedding(13, 8, device=device)
    ids = torch.randint(0, 13, shape, device=device)
    out = emb(ids)
    assert out.shape == (*shape, 8)
    torch.testing.assert_close(out, F.embedding(ids, emb.weight), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_integer_dtypes(dtype):
    emb = Embedding(10, 4)
    ids = torch.tensor([[0, 9, 3]], dtype=dtype)
    torch.testing.assert_close(emb(ids), emb.weight[[0, 9, 3]].unsqueeze(0), rtol=0, atol=0)


def test_does_not_call_f_embedding(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("F.embedding must not be used")

    monkeypatch.setattr(torch.nn.functional, "embedding", forbidden)
    emb = Embedding(5, 3)
    assert emb(torch.tensor([4, 0])).shape == (2, 3)
    assert not any(isinstance(m, torch.nn.Embedding) for m in emb.modules())


def test_layout_and_dtype(device):
    emb = Embedding(7, 3, device=device, dtype=torch.float64)
    assert emb.weight.shape == (7, 3)
    assert emb.weight.dtype == torch.float64
    assert set(emb.state_dict()) == {"weight"}


def test_gradcheck_weight():
    emb = Embedding(6, 3, dtype=torch.float64)
    ids = torch.tensor([[1, 1, 5], [0, 2, 1]])
    w = emb.weight.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda w: functional_call(emb, {"weight": w}, (ids,)), (w,))


def test_repeated_ids_accumulate_gradient():
    emb = Embedding(4, 2)
    emb(torch.tensor([1, 1, 1, 3])).sum().backward()
    expected = torch.tensor([[0.0, 0.0], [3.0, 3.0], [0.0, 0.0], [1.0, 1.0]])
    torch.testing.assert_close(emb.weight.grad, expected)


# The lookup is index_select, whose kernel refuses what indexing would not: a negative id (indexing wraps
# it to the end of the table) and one past the table, of any integer dtype and shape. No value is read back
# to the host for it (on an accelerator the kernel asserts on the device).
@pytest.mark.parametrize(
    "ids, dtype",
    [([0, 2, 5], torch.int64), ([-1, 2], torch.int64), (5, torch.int64), (-1, torch.int32), ([2, 12], torch.uint8),
     ([2, 12], torch.uint16), ([-3], torch.int8)],
)  # fmt: skip
def test_ids_outside_the_table_are_refused_not_wrapped(ids, dtype):
    with pytest.raises(IndexError, match="index out of range in self"):
        Embedding(5, 2)(torch.tensor(ids, dtype=dtype))


@pytest.mark.parametrize("ids", [torch.zeros(3), torch.tensor([True]), torch.tensor([1 + 0j])])
def test_ids_that_are_not_integers_are_refused(ids):
    with pytest.raises(RuntimeError, match="Expected dtype int32 or int64 for index"):
        Embedding(5, 2)(ids)


@pytest.mark.parametrize("args", [(0, 3), (3, 0)])
def test_bad_sizes(args):
    with pytest.raises(ValueError, match="must be positive, got 0"):
        Embedding(*args)


INTEGER_DTYPES = [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32]


@pytest.mark.parametrize("dtype", INTEGER_DTYPES)
def test_every_integer_dtype_is_an_id_never_a_mask(dtype, device):
    # uint8 would be read as a boolean mask by advanced indexing; index_select takes only int32/int64.
    emb = Embedding(120, 4, device=device)
    ids = torch.tensor([[0, 1, 1, 119], [5, 0, 2, 3]], device=device)
    expected = F.embedding(ids, emb.weight)
    torch.testing.assert_close(emb(ids.to(dtype)), expected, rtol=0, atol=0)


@pytest.mark.slow  # the first torch.compile in a process costs ~7 s of dynamo start-up
@pytest.mark.parametrize("bad", [[-1, 2], [2, 10]])
def test_out_of_range_ids_are_refused_under_torch_compile(bad):
    # A compiled graph cannot branch on values: the lookup's kernel refuses them there too.
    torch._dynamo.reset()
    compiled = torch.compile(Embedding(10, 4), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(torch.tensor([1, 9])).shape, torch.Size([2, 4]))
    with pytest.raises(IndexError, match="index out of range in self"):
        compiled(torch.tensor(bad))
    torch._dynamo.reset()


# Scalar and empty id tensors (issue 9, item 6), checked against F.embedding.
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int16])
def test_scalar_id_gives_one_row(dtype):
    emb = Embedding(10, 4)
    got = emb(torch.tensor(7, dtype=dtype))
    assert got.shape == (4,)
    torch.testing.assert_close(got, F.embedding(torch.tensor(7), emb.weight), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)])
def test_empty_ids_give_an_empty_result(shape):
    emb = Embedding(10, 4)
    ids = torch.zeros(shape, dtype=torch.long)
    got = emb(ids)
    assert got.shape == (*shape, 4) and got.dtype == emb.weight.dtype
    torch.testing.assert_close(got, F.embedding(ids, emb.weight))


@pytest.mark.parametrize("ids", [[0, 9], [9], [0]])
def test_the_edges_of_the_vocabulary_are_accepted(ids):
    emb = Embedding(10, 4)
    t = torch.tensor(ids)
    torch.testing.assert_close(emb(t), F.embedding(t, emb.weight), rtol=0, atol=0)


def test_uint8_ids_are_ids_not_a_mask():
    emb = Embedding(10, 4)
    ids = torch.tensor([1, 0, 1], dtype=torch.uint8)
    torch.testing.assert_close(emb(ids), F.embedding(ids.long(), emb.weight), rtol=0, atol=0)
