import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

from tlm_model import InferenceModel, ModelConfig, TransformerLM, compile_for_inference, generate

# One layer: every layer compiles to the same kernels, so more layers only add tracing time.
CFG = ModelConfig(vocab_size=61, context_length=40, d_model=32, num_layers=1, num_heads=4, d_ff=64)


@pytest.mark.slow
def test_compiled_inference_matches_eager_prefill_and_greedy_decoding():
    # A real inductor compile (C++) of two graphs: the prompt, then a decode step whose cache length is a
    # dynamic size. max-autotune would also build and time every candidate kernel of every matrix multiply;
    # here its search space is inductor's C++ GEMM template alone, the kernels that make compiled decoding
    # fast, so those are what is compared with eager, and no time goes to timing candidates.
    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    fast = compile_for_inference(model)
    assert fast.config == model.config
    prompt = torch.randint(0, CFG.vocab_size, (2, 4))
    with inductor_config.patch(max_autotune_gemm_backends="CPP"):
        greedy, (prefill_code, decode_code) = run_and_get_code(generate, fast, prompt, 20, temperature=0)
        # The whole-model forward (a third graph) under the same search space: its GEMMs are not timed
        # against ATen's either, which would double this test's time for nothing it asserts.
        with torch.no_grad():
            cache, eager_cache = fast.new_kv_cache(2), model.new_kv_cache(2)
            torch.testing.assert_close(fast(prompt, kv_cache=cache), model(prompt, kv_cache=eager_cache))
    assert torch.equal(greedy, generate(model, prompt, 20, temperature=0))
    for code in (prefill_code, decode_code):
        assert "micro_gemm" in code, "the compiled graph has no C++ GEMM kernel"


@pytest.mark.slow
def test_on_a_cpu_the_decode_steps_of_two_rows_and_more_share_one_graph_on_onednn_gemms():
    # The batch is a symbolic size of the CPU decode step above one row: one graph serves buckets 2 and 4,
    # and inductor packs the frozen weights for oneDNN's GEMM (2.5x MKL's at 16 rows on the AMD CPU measured,
    # where MKL takes its generic path), not MKL's, which it picks for a constant batch. Only ATen's kernels
    # are candidates here, so no time goes to timing C++ ones.
    from torch._dynamo.utils import counters

    from tlm_model.batching import DecodeBatch

    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 5, 2, 7)]
    fast, eager = DecodeBatch(compile_for_inference(model), 4), DecodeBatch(model, 4)
    with inductor_config.patch(max_autotune_gemm_backends="ATEN"):
        for batch in (fast, eager):
            batch.add_many(prompts[:2])
        tokens = torch.tensor([4, 9])
        logits, (code,) = run_and_get_code(fast.step, tokens)  # bucket 2: the step's one compilation
        torch.testing.assert_close(logits, eager.step(tokens), rtol=1e-5, atol=1e-5)
        assert "mkldnn._linear_pointwise" in code and "mkl._mkl_linear" not in code
        for batch in (fast, eager):
            batch.add_many(prompts[2:])  # prompt chunks: graphs of their own
        graphs = counters["stats"]["unique_graphs"]
        tokens = torch.tensor([1, 2, 3, 5])
        torch.testing.assert_close(fast.step(tokens), eager.step(tokens), rtol=1e-5, atol=1e-5)  # bucket 4
    assert counters["stats"]["unique_graphs"] == graphs  # bucket 2's graph ran it


def test_rejects_other_modules():
    with pytest.raises(TypeError, match="model must be a TransformerLM, got Linear"):
        InferenceModel(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("bad", [-1, CFG.vocab_size])
def test_ids_the_eager_model_refuses_are_refused_before_the_compiled_graph(bad):
    # Issue 35 item 7: a compiled gather would wrap -1 round to the last row; the boundary reads the ids' range
    # once, outside the graph, and raises the eager model's IndexError (nothing is compiled for it).
    model = TransformerLM(CFG).eval()
    ids = torch.tensor([[1, bad]])
    with pytest.raises(IndexError, match="index out of range"):
        model(ids)
    with pytest.raises(IndexError, match=r"in_indices must lie in \[0, vocab_size=61\), got values in"):
        compile_for_inference(model)(ids)
    with pytest.raises(TypeError, match="in_indices must be an integer tensor, got dtype torch.float32"):
        compile_for_inference(model)(ids.float())


def test_positions_that_could_contradict_the_cache_are_refused_by_the_compiled_model_too():
    model = TransformerLM(CFG).eval()
    cache = model.new_kv_cache(1)
    with pytest.raises(ValueError, match="token_positions must be None with a kv_cache"):
        compile_for_inference(model)(torch.tensor([[1, 2]]), torch.tensor([[5, 6]]), cache)
    assert cache.lengths == (0,)
