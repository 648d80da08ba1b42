import pytest
import torch

from tlm_model import InferenceModel, ModelConfig, TransformerLM, compile_for_inference, generate

CFG = ModelConfig(vocab_size=61, context_length=40, d_model=32, num_layers=2, num_heads=4, d_ff=64)


def test_compiled_inference_matches_eager_prefill_and_greedy_decoding():
    # A real inductor compile (C++), so this test takes several seconds.
    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    fast = compile_for_inference(model)
    assert fast.config == model.config
    prompt = torch.randint(0, CFG.vocab_size, (2, 4))
    # Compiles twice: the prompt, then a decode step whose cache length is a dynamic size.
    assert torch.equal(generate(fast, prompt, 20, temperature=0), generate(model, prompt, 20, temperature=0))
    with torch.no_grad():
        cache, eager_cache = fast.new_kv_cache(2), model.new_kv_cache(2)
        torch.testing.assert_close(fast(prompt, kv_cache=cache), model(prompt, kv_cache=eager_cache))


def test_rejects_other_modules():
    with pytest.raises(TypeError, match="model must be a TransformerLM, got Linear"):
        InferenceModel(torch.nn.Linear(2, 2))
