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

import torch
from jaxtyping import Bool, Integer
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
