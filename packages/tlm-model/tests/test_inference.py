import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

from tlm_model import InferenceModel, ModelConfig, TransformerLM, compile_for_inference, generate
from tlm_model.batching import DecodeBatch

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
        # The prompt graph's logits after every token, against the eager model's forward: the same graph (its
        # sizes are dynamic), so nothing more compiles. (InferenceModel's own forward with a cache, a graph of
        # its own, is traced without inductor below.)
        logits = DecodeBatch(fast, 2).add_many(list(prompt), every_position=True)
    with torch.no_grad():
        torch.testing.assert_close(torch.stack(logits), model(prompt))
    assert torch.equal(greedy, generate(model, prompt, 20, temperature=0))
    for code in (prefill_code, decode_code):
        assert "micro_gemm" in code, "the compiled graph has no C++ GEMM kernel"


@pytest.mark.slow
def test_on_a_cpu_the_decode_steps_of_two_rows_and_more_share_one_graph_on_onednn_gemms():
    # The batch is a symbolic size of the CPU decode step above one row: one graph serves buckets 2 and 4,
    # and inductor packs the frozen weights for oneDNN's GEMM (2.5x MKL's at 16 rows on the AMD CPU measured,
    # where MKL takes its generic path), not MKL's, which it picks for a constant batch. Only ATen's kernels
    # are candidates here, so no time goes to timing C++ ones.
    # The prompts are prefilled by the eager model and the compiled batches take its rows over (as tlm serve's
    # compiled engine does once warmed up): the prompt chunks' graphs are no part of this.
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 5, 2, 7)]
    compiled, eager = compile_for_inference(model), DecodeBatch(model, 4)
    counters.clear()
    with inductor_config.patch(max_autotune_gemm_backends="ATEN"):
        eager.add_many(prompts[:2])
        fast = DecodeBatch(compiled, 4)
        fast.take_over(eager)
        tokens = torch.tensor([4, 9])
        logits, (code,) = run_and_get_code(fast.step, tokens)  # bucket 2: the step's one compilation
        torch.testing.assert_close(logits, eager.step(tokens), rtol=1e-5, atol=1e-5)
        assert "mkldnn._linear_pointwise" in code and "mkl._mkl_linear" not in code
        assert counters["stats"]["unique_graphs"] == 1
        eager.add_many(prompts[2:])
        fast = DecodeBatch(compiled, 4)
        fast.take_over(eager)
        tokens = torch.tensor([1, 2, 3, 5])
        torch.testing.assert_close(fast.step(tokens), eager.step(tokens), rtol=1e-5, atol=1e-5)  # bucket 4
    assert counters["stats"]["unique_graphs"] == 1  # bucket 2's graph ran it


def test_the_compiled_forward_with_a_cache_continues_its_rows_like_the_eager_model(recorded_graphs):
    # InferenceModel.forward with a kv_cache: the prompt-chunk graph continues every row (a prompt, then more
    # tokens), the caches' lengths advance, and the logits are the eager model's. Dynamo's graphs run as traced
    # (the recording backend): the wiring is what is checked here; inductor's kernels are checked above.
    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    fast = compile_for_inference(model)
    ids = torch.randint(0, CFG.vocab_size, (2, 7))
    with torch.no_grad():
        cache, eager_cache = fast.new_kv_cache(2), model.new_kv_cache(2)
        parts = [fast(part, kv_cache=cache) for part in (ids[:, :4], ids[:, 4:])]
        assert cache.lengths == (7, 7)
        torch.testing.assert_close(torch.cat(parts, dim=1), model(ids))  # the whole sequence in one forward
        torch.testing.assert_close(parts[0], model(ids[:, :4], kv_cache=eager_cache))
        torch.testing.assert_close(parts[1], model(ids[:, 4:], kv_cache=eager_cache))
    assert recorded_graphs  # it ran compiled


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
