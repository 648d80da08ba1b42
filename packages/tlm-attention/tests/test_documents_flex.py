"""Document masks through FlexAttention (issue 42): the block mask built from document ids block by block lists
exactly the key blocks that hold an allowed pair (a superset for ids that are not non-decreasing), and
FlexAttention under it equals torch's SDPA under the dense document mask. On a CPU FlexAttention runs its eager
forward (it has no CPU backward); on CUDA (TLM_TEST_DEVICE=cuda) the compiled kernel, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from tlm_attention import document_ids, document_mask
from tlm_attention.documents import document_block_mask, flex_applies, flex_document_attention

EOT = 0


def _ids(seq: int, lengths: list[int]) -> torch.Tensor:
    """Token ids whose documents have the given lengths (each closed by EOT), as one (1, seq) window."""
    tokens = torch.ones(seq, dtype=torch.int64)
    at = -1
    for length in lengths:
        at += length
        if at < seq:
            tokens[at] = EOT
    return document_ids(tokens.unsqueeze(0), EOT)


def _blocks_with_a_pair(mask: torch.Tensor, block: int) -> torch.Tensor:
    """(batch, query blocks, key blocks): whether the dense (batch, 1, seq, seq) mask allows any pair there."""
    batch, _, seq, _ = mask.shape
    n = seq // block
    return mask.reshape(batch, n, block, n, block).any(-1).any(-2)


@pytest.mark.parametrize("lengths", [[64], [10, 30, 24], [1, 1, 40, 5, 17], [16, 16, 16, 16], [33, 31]])
def test_the_block_mask_lists_exactly_the_blocks_that_hold_an_allowed_pair(lengths) -> None:
    ids = torch.cat([_ids(64, lengths), _ids(64, lengths[::-1])])
    mask = document_block_mask(ids, block=8)
    listed = mask.to_dense()[:, 0].bool()  # (batch, query blocks, key blocks): partial or full
    assert torch.equal(listed, _blocks_with_a_pair(document_mask(ids), 8))
    assert mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum() < ids.shape[0] * 8 * 9 // 2 or len(lengths) == 1


def test_for_any_ids_the_listed_blocks_cover_every_allowed_pair() -> None:
    # Ids need only be equal within a document: a block whose range overlaps another's may be listed with no
    # pair in common (the element mask then masks it all), but no block with an allowed pair is ever skipped.
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 3, (3, 64), generator=generator)
    listed = document_block_mask(ids, block=8).to_dense()[:, 0].bool()
    needed = _blocks_with_a_pair(document_mask(ids), 8)
    assert torch.equal(listed | needed, listed)


@pytest.mark.slow  # FlexAttention's first eager call traces its higher-order op through dynamo: seconds
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the eager path, on purpose
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_flex_attention_under_the_block_mask_equals_sdpa_under_the_dense_mask(heads, kv_heads) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    generator = torch.Generator().manual_seed(1)
    ids = torch.cat([_ids(64, [10, 30, 24]), _ids(64, [1, 1, 40, 5, 17])])
    q = torch.randn(2, heads, 64, 16, generator=generator)
    k, v = (torch.randn(2, kv_heads, 64, 16, generator=generator) for _ in range(2))
    with torch.no_grad():
        got = flex_attention(q, k, v, block_mask=document_block_mask(ids, block=8), enable_gqa=heads != kv_heads)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(ids), enable_gqa=heads != kv_heads)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_flex_takes_cuda_windows_of_whole_blocks_only() -> None:
    ids = torch.zeros(2, 256, dtype=torch.int64)
    q = torch.zeros(2, 4, 256, 16)
    assert not flex_applies(q, ids)  # a CPU: no FlexAttention backward there, the dense mask instead
    assert not flex_applies(q.to("meta"), ids.to("meta"))


def test_on_the_device_flex_document_attention_matches_the_dense_mask_forward_and_backward(device) -> None:
    if device.type != "cuda":
        pytest.skip("FlexAttention has no CPU backward; its CPU forward is the test above")
    generator = torch.Generator().manual_seed(2)
    ids = torch.cat([_ids(256, [100, 150, 6]), _ids(256, [256])]).to(device)
    q = torch.randn(2, 4, 256, 32, generator=generator).to(device).requires_grad_()
    k, v = (torch.randn(2, 2, 256, 32, generator=generator).to(device).requires_grad_() for _ in range(2))
    assert flex_applies(q, ids)
    got = flex_document_attention(q, k, v, ids)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(ids), enable_gqa=True)
    expected = torch.autograd.grad(want.square().sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)


def test_building_the_block_mask_reads_nothing_back_to_the_host(host_reads) -> None:
    ids = torch.cat([_ids(64, [10, 30, 24]), _ids(64, [64])])
    with host_reads() as reads:
        document_block_mask(ids, block=8)
    assert reads == []


def test_flex_document_attention_names_the_triton_kernels_whose_backward_is_deterministic(monkeypatch) -> None:
    """``deterministic=True`` keeps FlexAttention for document masks on CUDA (issue 42): inductor's Triton backward
    writes every dQ/dK/dV block from one program in a fixed order (no atomics without a score_mod), while
    BACKEND="FLASH" has a deterministic block-sparse backward only on SM100+, and "AUTO" may change its pick. So
    the call names TRITON wherever this torch takes a BACKEND; pinned here on the CPU with the call recorded, and
    the option is one torch's own FlexAttention accepts, with the default kernel's result."""
    import warnings

    import torch.nn.attention.flex_attention as flex

    import tlm_attention.documents as documents

    calls = []
    monkeypatch.setattr(documents, "_FLEX", lambda *args, **kwargs: calls.append(kwargs) or args[0])
    ids = _ids(128, [100, 28])
    q = torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(0))
    flex_document_attention(q, q, q, ids)
    assert "BACKEND" in flex.FlexKernelOptions.__annotations__  # torch 2.13 has the choice
    assert calls[0]["kernel_options"] == {"BACKEND": "TRITON"}
    block_mask = document_block_mask(ids)
    with warnings.catch_warnings():  # the eager forward (the CPU's) warns, once a process, that it is not compiled
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile", UserWarning)
        named = flex.flex_attention(q, q, q, block_mask=block_mask, kernel_options=calls[0]["kernel_options"])
        torch.testing.assert_close(named, flex.flex_attention(q, q, q, block_mask=block_mask), rtol=0, atol=0)
    monkeypatch.delattr(flex.FlexKernelOptions, "__annotations__")  # an older torch: nothing to choose
    assert documents.flex_kernel_options() == {}


def test_on_the_device_flex_backward_is_bit_identical_under_deterministic_algorithms(device) -> None:
    if device.type != "cuda":
        pytest.skip("FlexAttention has no CPU backward")
    generator = torch.Generator().manual_seed(3)
    ids = torch.cat([_ids(512, [100, 300, 112]), _ids(512, [512])]).to(device)
    q = torch.randn(2, 4, 512, 64, generator=generator).to(device, torch.bfloat16).requires_grad_()
    k, v = (torch.randn(2, 2, 512, 64, generator=generator).to(device, torch.bfloat16).requires_grad_() for _ in "kv")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=False)  # what deterministic=True sets on CUDA
    try:
        runs = []
        for _ in range(3):
            out = flex_document_attention(q, k, v, ids)
            runs.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))
