"""Scalar and empty id tensors (issue 9, item 6), checked against ``F.embedding``."""

import pytest
import torch
import torch.nn.functional as F

from tlm_linear import Embedding


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


def test_scalar_id_out_of_range_is_refused():
    emb = Embedding(10, 4)
    with pytest.raises(ValueError, match=r"token_ids must lie in \[0, num_embeddings=10\), got values in \[10, 10\]"):
        emb(torch.tensor(10))
    with pytest.raises(ValueError, match=r"got values in \[-1, -1\]"):
        emb(torch.tensor(-1))


@pytest.mark.parametrize("ids", [[0, 9], [9], [0]])
def test_the_edges_of_the_vocabulary_are_accepted(ids):
    emb = Embedding(10, 4)
    t = torch.tensor(ids)
    torch.testing.assert_close(emb(t), F.embedding(t, emb.weight), rtol=0, atol=0)


def test_uint8_ids_are_ids_not_a_mask():
    emb = Embedding(10, 4)
    ids = torch.tensor([1, 0, 1], dtype=torch.uint8)
    torch.testing.assert_close(emb(ids), F.embedding(ids.long(), emb.weight), rtol=0, atol=0)


def test_complex_and_bool_ids_are_refused():
    emb = Embedding(10, 4)
    for ids in (torch.tensor([1 + 0j]), torch.tensor([True])):
        with pytest.raises(TypeError, match="token_ids must be an integer tensor"):
            emb(ids)
