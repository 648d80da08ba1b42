"""The model's hot path never reads a tensor value back to the host.

On an accelerator each read (``.item()``, ``bool(t)``, ``int(t.max())``, ``.tolist()``) waits for every
queued kernel, so a forward with one in it cannot run ahead of the device. The root conftest's
``host_reads`` counts them: ``aten::_local_scalar_dense`` under a ``TorchDispatchMode`` and the
Python-level reads under a ``TorchFunctionMode``. On the CPU the reads would cost little, but the code
path is the one every device runs.
"""

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM

CFG = ModelConfig(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)
GQA = ModelConfig(
    vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48, num_kv_heads=2,
    tie_word_embeddings=True,
)  # fmt: skip


@pytest.mark.parametrize(
    "config, options",
    [
        (CFG, {}),
        (CFG, {"fused": False, "attention_backend": "reference"}),
        (CFG, {"attention_backend": "blockwise"}),
        (GQA, {}),
    ],
    ids=["default", "unfused-reference", "blockwise", "gqa-tied"],
)
def test_forward_loss_backward_and_a_cached_decode_step_read_nothing(config, options, host_reads):
    model = TransformerLM(config, **options)
    ids = torch.randint(0, config.vocab_size, (2, 8), dtype=torch.int32)  # a narrow dtype is widened, not read
    targets = torch.randint(0, config.vocab_size, (2, 8))
    cache = model.new_kv_cache(2)
    with torch.no_grad():
        model(ids, kv_cache=cache)  # the prefill
    with host_reads() as reads:
        model(ids)
        model.loss(ids, targets).backward()
        with torch.no_grad():
            model(ids[:, :1], kv_cache=cache)  # one decode step
            model.loss(ids, targets)  # evaluation
    assert reads == []
    assert cache.lengths == (9, 9)


@pytest.mark.parametrize("options", [{}, {"attention_backend": "reference"}], ids=["default", "reference"])
def test_a_decode_step_of_rows_of_different_lengths_reads_nothing(options, host_reads):
    # Rows at their own lengths (issue 25): positions come from the cache's host-side lengths, not from a tensor.
    model = TransformerLM(CFG, **options)
    cache = model.new_kv_cache(2)
    with torch.no_grad():
        model(torch.randint(0, CFG.vocab_size, (2, 6)), kv_cache=cache)
        cache.truncate([6, 3])
        with host_reads() as reads:
            model(torch.randint(0, CFG.vocab_size, (2, 1)), kv_cache=cache)
    assert reads == []
    assert cache.lengths == (7, 4)


def test_a_static_cache_step_and_batched_sampling_read_nothing(host_reads):
    # Issue 34: DecodeBatch's step (positions from the caches' device lengths, the mask built on the device) and
    # sample_tokens with per-row settings and generators: the tokens stay on the device until a caller reads them.
    from tlm_model import sample_tokens
    from tlm_model.batching import DecodeBatch

    model = TransformerLM(CFG).eval()
    batch = DecodeBatch(model, 4, prefill_chunk=4)
    logits = batch.add_many([torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6, 7, 8, 9])])
    generators = [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)]
    with host_reads() as reads:
        for _ in range(3):
            tokens = sample_tokens(logits, [0.8, 0.0, 1.2], [5, None, 0], [0.9, None, 1.0], generators)
            logits = batch.step(tokens)
    assert reads == []
    assert batch.lengths == (6, 4, 8)
