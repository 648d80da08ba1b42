"""Document masking in the model: the loss of a packed window is the sum of each document's loss alone, on
every attention backend, with no value read back to the host."""

import dataclasses

import pytest
import torch

from tlm_attention import document_ids
from tlm_model import ModelConfig, TransformerLM

EOT = 0
CFG = ModelConfig(vocab_size=32, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48, num_kv_heads=2)
# Inputs and targets of two packed windows (targets: the inputs shifted by one, as the sampler cuts them).
STREAM = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 0, 4, 11], [0, 3, 3, 3, 0, 2, 2, 1, 0, 9]])
INPUTS, TARGETS = STREAM[:, :-1], STREAM[:, 1:]


@pytest.mark.parametrize("backend", ["reference", "blockwise", "torch"])
@pytest.mark.parametrize("positions", ["rope", "none"])
def test_a_packed_window_loss_is_the_sum_of_its_documents_alone(backend, positions):
    torch.manual_seed(0)
    model = TransformerLM(dataclasses.replace(CFG, positions=positions), attention_backend=backend, dtype=torch.float64)
    ids = document_ids(INPUTS, EOT)
    packed = model.loss(INPUTS, TARGETS, document_ids=ids) * TARGETS.numel()
    alone = torch.zeros((), dtype=torch.float64)
    documents = 0
    for b in range(2):
        # Each document cut out of the window: its inputs and the targets at the same places.
        for doc in ids[b].unique().tolist():
            where = (ids[b] == doc).nonzero().squeeze(-1)
            alone = alone + model.loss(INPUTS[b, where][None], TARGETS[b, where][None]) * len(where)
            documents += 1
    assert documents == 7
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)
    # The mask is not a no-op here: without it the window's loss differs.
    assert not torch.allclose(model.loss(INPUTS, TARGETS) * TARGETS.numel(), alone)


def test_logits_with_explicit_positions_and_gradients_flow():
    torch.manual_seed(0)
    model = TransformerLM(CFG)
    ids = document_ids(INPUTS, EOT)
    logits = model(INPUTS, document_ids=ids)
    torch.testing.assert_close(logits[:1, 3:7], model(INPUTS[:1, 3:7]), rtol=1e-5, atol=1e-5)
    model.loss(INPUTS, TARGETS, document_ids=ids).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("backend", ["reference", "blockwise", "torch"])
def test_the_document_masked_step_reads_nothing_back(backend, host_reads):
    model = TransformerLM(CFG, attention_backend=backend)
    with host_reads() as reads:
        model.loss(INPUTS, TARGETS, document_ids=document_ids(INPUTS, EOT)).backward()
    assert reads == []


def test_document_ids_with_a_kv_cache_are_refused():
    model = TransformerLM(CFG)
    with pytest.raises(ValueError, match="document_ids"):
        model(INPUTS, kv_cache=model.new_kv_cache(2), document_ids=document_ids(INPUTS, EOT))
