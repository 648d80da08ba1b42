"""Document masking for packed sequences: documents joined in one window never attend to each other.

A training window of ``seq`` tokens cut from a stream of documents joined by an end-of-text token
usually holds the end of one document and the start of the next. Plain causal attention lets the second
document's first tokens read the first's last ones. With document ids (one per token, equal within a
document) attention is causal *and* within a document, and RoPE positions restart at 0 at each document's
first token, so each document is computed exactly as it would be alone (torchtitan's and torchtune's
document masking, there through FlexAttention's ``mask_mod``).

Everything here is computed on the device from the tokens (``cumsum``, ``cummax``, comparisons): no value
is read back to the host, so a training step stays asynchronous.
"""

from typing import Any

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor


def document_ids(tokens: Integer[Tensor, "... seq"], eot_id: int) -> Integer[Tensor, "... seq"]:
    """Each token's document within its window: the number of ``eot_id`` tokens strictly before it.

    The end-of-text token closes the document it ends (it belongs to it, and the prediction made from it
    sees only that document), as torchtitan's ``eos_id`` document mask does."""
    ends = (tokens == eot_id).to(torch.int64)
    return ends.cumsum(-1) - ends


def document_positions(ids: Integer[Tensor, "... seq"]) -> Integer[Tensor, "... seq"]:
    """Each token's position within its document: 0 at the first token of every run of equal ids."""
    seq = ids.shape[-1]
    index = torch.arange(seq, device=ids.device).expand(ids.shape)
    starts = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    # The index where each token's document began: the running maximum of the start indices so far.
    began = torch.where(starts, index, 0).cummax(-1).values
    return index - began


def document_mask(ids: Integer[Tensor, "*batch seq"]) -> Bool[Tensor, "*batch 1 seq seq"]:
    """The boolean attention mask (True = may attend) of causal attention within documents: query i sees
    key j when j <= i and both have the same id. Shaped (batch, 1, queries, keys), it broadcasts over the
    heads and is what every attention backend takes as ``mask=``. The diagonal is always True, so no row
    is ever fully masked (torch's fused kernels would give NaN there)."""
    seq = ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
    return ((ids.unsqueeze(-1) == ids.unsqueeze(-2)) & causal).unsqueeze(-3)


#: FlexAttention's block size: the block mask says which (query block, key block) pairs to compute at all.
FLEX_BLOCK = 128


def document_block_mask(ids: Integer[Tensor, "batch seq"], block: int = FLEX_BLOCK) -> Any:
    """FlexAttention's ``BlockMask`` of causal attention within documents, built from ``ids`` block by block
    (never the (seq, seq) mask): a key block is skipped when its ids' range and the query block's do not
    overlap (no id in common is then possible), and computed without the per-element mask when both blocks
    hold one and the same id and the key block lies wholly before the query block. Correct for any ids (equal
    within a document), and tight for :func:`document_ids`' non-decreasing ones. ``seq`` must be a multiple
    of ``block``. Device operations only: nothing is read back to the host."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, seq = ids.shape
    blocks = seq // block
    grouped = ids.reshape(batch, blocks, block)
    low, high = grouped.amin(-1), grouped.amax(-1)  # (batch, blocks) each
    index = torch.arange(blocks, device=ids.device)
    causal = index.unsqueeze(1) >= index.unsqueeze(0)  # (query block, key block)
    overlap = (low.unsqueeze(2) <= high.unsqueeze(1)) & (low.unsqueeze(1) <= high.unsqueeze(2))
    single = low == high
    full = (index.unsqueeze(1) > index.unsqueeze(0)) & single.unsqueeze(2) & single.unsqueeze(1)
    full = full & (low.unsqueeze(2) == low.unsqueeze(1))
    partial = causal & overlap & ~full

    def listed(chosen: Tensor) -> tuple[Tensor, Tensor]:
        # (batch, 1, query blocks) counts, and the chosen key blocks first in each row (stable: ascending).
        order = torch.sort((~chosen).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return chosen.sum(-1, dtype=torch.int32).unsqueeze(1), order.unsqueeze(1)

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (ids[b, q] == ids[b, kv]) & (q >= kv)

    counts, indices = listed(partial)
    full_counts, full_indices = listed(full)
    return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=block, mask_mod=mask_mod)


_FLEX: Any = None


def flex_kernel_options() -> dict[str, str]:
    """The ``kernel_options`` every FlexAttention call here passes: its Triton kernels, named where this torch
    lets a call choose (``FlexKernelOptions``'s ``BACKEND``; feature-detected, older ones have no other).

    This is what keeps ``deterministic=True`` true with document masks on CUDA. The Triton backward
    (inductor's ``flex_backwards`` template) writes each block of dQ, and each block of dK and dV, from one
    program that loops over the other side's blocks in a fixed order: no atomic adds (inductor's only ones there
    scatter gradients into tensors a ``score_mod`` captures; a ``mask_mod`` alone has none). ``"FLASH"``
    (flash-attn 4) has a deterministic block-sparse backward only on SM100+ with extra block-mask metadata, and
    ``"AUTO"`` is free to change what it picks."""
    from torch.nn.attention import flex_attention as flex

    options = getattr(flex, "FlexKernelOptions", None)
    return {"BACKEND": "TRITON"} if "BACKEND" in getattr(options, "__annotations__", {}) else {}


def flex_document_attention(
    q: Float[Tensor, "batch heads seq d_head"],
    k: Float[Tensor, "batch kv_heads seq d_head"],
    v: Float[Tensor, "batch kv_heads seq d_head"],
    ids: Integer[Tensor, "batch seq"],
) -> Float[Tensor, "batch heads seq d_head"]:
    """Causal attention within documents through FlexAttention (compiled once per process): memory O(seq) and
    the key blocks of other documents skipped, where the dense mask (:func:`document_mask`) costs (seq, seq)
    per row and keeps torch's SDPA on its math kernel. Query head h reads key/value head
    h // (heads / kv_heads). ``seq`` a multiple of :data:`FLEX_BLOCK`. The kernels are FlexAttention's Triton
    ones, whose backward is deterministic (:func:`flex_kernel_options`)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    block_mask = document_block_mask(ids)
    options = flex_kernel_options()
    kwargs = {"kernel_options": options} if options else {}
    return _FLEX(q, k, v, block_mask=block_mask, enable_gqa=q.shape[-3] != k.shape[-3], **kwargs)


def flex_applies(q: Tensor, ids: Tensor | None) -> bool:
    """Whether :func:`flex_document_attention` takes this call: CUDA (FlexAttention has no CPU backward, and
    compiling it on a CPU costs more than the dense mask saves), a (batch, seq) window of whole blocks."""
    return (
        ids is not None
        and q.device.type == "cuda"
        and ids.ndim == 2
        and q.ndim == 4
        and q.shape[-2] == ids.shape[-1]
        and ids.shape[-1] % FLEX_BLOCK == 0
    )
