import pytest
import torch
import torch._dynamo

from tlm_attention import BACKENDS, resolve_attention_backend
from tlm_model import ModelConfig, TransformerLM

# slow: each test traces the whole model with dynamo (~6-25 s each on a 2-core CPU).
pytestmark = pytest.mark.slow

CFG = ModelConfig(vocab_size=61, context_length=40, d_model=32, num_layers=2, num_heads=4, d_ff=64)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Each implementation once: "auto" is torch's (resolved when the model is built, test_backends.py), and tracing it
# again would trace the very same code.
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("backend", sorted(set(map(resolve_attention_backend, BACKENDS))))
def test_forward_traces_as_one_graph(backend, fused):
    model = TransformerLM(CFG, attention_backend=backend, fused=fused).eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 10))
    explanation = torch._dynamo.explain(model)(ids)
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_count == 1


def test_fullgraph_compile_matches_eager_and_trains():
    model = TransformerLM(CFG)
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # dynamo tracing, no C++ build
    ids = torch.randint(0, CFG.vocab_size, (2, 12))
    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-6)
    compiled(ids).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_cached_decoding_does_not_recompile_every_token():
    model = TransformerLM(CFG).eval()
    compilations = []

    def counting_backend(graph_module, example_inputs):
        compilations.append(len(example_inputs))
        return graph_module.forward

    compiled = torch.compile(model, fullgraph=True, backend=counting_backend)
    with torch.no_grad():
        cache = model.new_kv_cache(1)
        compiled(torch.randint(0, CFG.vocab_size, (1, 5)), kv_cache=cache)
        for _ in range(20):
            compiled(torch.randint(0, CFG.vocab_size, (1, 1)), kv_cache=cache)
    # The prompt, then the first decode step; after that the cache length is a dynamic size.
    assert len(compilations) <= 2


def test_a_compiled_cached_step_that_fails_leaves_the_caches_as_they_were():
    # Dynamo applies the caches' new lengths only after the whole graph ran, so a kernel that refuses
    # its input half-way changes no length; an id outside the vocabulary shows it.
    model = TransformerLM(CFG).eval()
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # dynamo's side effects, no C++ build
    ids = torch.randint(0, CFG.vocab_size, (1, 8))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_kv_cache(1)
        steps = [compiled(ids[:, :5], kv_cache=cache)]
        with pytest.raises(IndexError, match="index out of range in self"):
            compiled(torch.tensor([[CFG.vocab_size]]), kv_cache=cache)
        assert cache.lengths == (5,)
        steps += [compiled(ids[:, t : t + 1], kv_cache=cache) for t in range(5, 8)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
