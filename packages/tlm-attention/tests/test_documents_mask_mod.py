"""The element mask a document block mask carries (what FlexAttention applies inside a partial block), element by
element (its indices broadcast over every batch row, query and key), against causal attention within documents
written out here; and FlexAttention's gate with no document ids on a tensor that says it is on CUDA. Both run on a
CPU without calling FlexAttention (its slow tests do)."""

import torch

from tlm_attention.documents import document_block_mask, flex_applies


def test_the_block_masks_element_mask_is_causal_within_each_document():
    ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 2, [0] * 16, [0, 1] * 8])
    mask = document_block_mask(ids, block=8)
    index = torch.arange(16)
    got = mask.mask_mod(torch.arange(3)[:, None, None], torch.zeros(()), index[:, None], index[None, :])
    want = torch.zeros(3, 16, 16, dtype=torch.bool)
    for b in range(3):
        for q in range(16):
            for kv in range(q + 1):
                want[b, q, kv] = bool(ids[b, q] == ids[b, kv])
    assert torch.equal(got, want)


class _OnCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device: the gate's checks after the device's are reached on a CPU."""

    device = property(lambda self: torch.device("cuda", 0))


def test_no_document_ids_never_take_flexattention_on_cuda():
    q = torch.zeros(2, 4, 256, 16).as_subclass(_OnCuda)
    assert q.device.type == "cuda"
    assert flex_applies(q, None) is False
    assert flex_applies(q, torch.zeros(2, 256, dtype=torch.int64)) is True  # the same call with ids is taken
