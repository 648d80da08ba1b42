import pytest
import torch

from tlm_attention import BACKENDS
from tlm_model import ModelConfig, TransformerLM, generate

CFG = ModelConfig(vocab_size=61, context_length=40, d_model=32, num_layers=2, num_heads=4, d_ff=64)


@pytest.fixture
def model():
    return TransformerLM(CFG).eval()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_logits_equal_a_full_forward_at_every_step(backend, device):
    model = TransformerLM(CFG, attention_backend=backend, device=device).eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 30), device=device)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_kv_cache(2)
        steps = [model(ids[:, :6], kv_cache=cache)]
        steps += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(6, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)


def greedy_without_cache(model, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_greedy_with_and_without_cache_identical(model):
    prompt = torch.randint(0, CFG.vocab_size, (3, 5))
    with torch.no_grad():
        expected = greedy_without_cache(model, prompt, 25)
    assert torch.equal(generate(model, prompt, 25, temperature=0), expected)
    assert torch.equal(generate(model, prompt[0], 25, temperature=0), expected[0])  # 1-d prompt


def test_prefix_is_never_recomputed(model):
    seen = []
    hook = model.token_embeddings.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[-1]))
    try:
        generate(model, torch.randint(0, CFG.vocab_size, (1, 7)), 5, temperature=0)
    finally:
        hook.remove()
    assert seen == [7, 1, 1, 1, 1]  # the prompt once, then one new token per step (the last is not fed back)


def test_rope_positions_continue_from_the_cache(model):
    ids = torch.randint(0, CFG.vocab_size, (1, 12))
    with torch.no_grad():
        cache = model.new_kv_cache(1)
        model(ids[:, :8], kv_cache=cache)
        continued = model(ids[:, 8:], kv_cache=cache)
        explicit = model(ids)[:, 8:]
    torch.testing.assert_close(continued, explicit, rtol=1e-4, atol=1e-5)


def test_sampling_is_reproducible_with_a_generator(model):
    prompt = torch.randint(0, CFG.vocab_size, (2, 4))
    a = generate(model, prompt, 10, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(3))
    b = generate(model, prompt, 10, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (2, 14)


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    prompt = torch.randint(0, CFG.vocab_size, (2, 4))
    greedy = generate(model, prompt, 8, temperature=0)
    assert torch.equal(generate(model, prompt, 8, temperature=1.5, top_k=1), greedy)
    assert torch.equal(generate(model, prompt, 8, temperature=1.5, top_p=1e-6), greedy)


def test_top_p_keeps_the_smallest_set_reaching_p():
    from tlm_model.generate import _filter_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(_filter_logits(logits, None, 0.75))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(_filter_logits(logits, 3, None))
    assert kept.tolist() == [[True, True, True, False]]


def test_eos_stops_each_row(model):
    prompt = torch.randint(0, CFG.vocab_size, (2, 3))
    greedy = generate(model, prompt, 12, temperature=0)
    eos = int(greedy[0, 3])  # row 0 emits this first
    out = generate(model, prompt, 12, temperature=0, eos_token_id=eos)
    assert out[0, 3] == eos and (out[0, 3:] == eos).all()
    hits = (greedy[1, 3:] == eos).nonzero()
    if hits.numel() == 0:  # row 1 never emits eos: it runs to the end unchanged
        assert torch.equal(out[1], greedy[1])


def test_zero_new_tokens_returns_the_prompt(model):
    prompt = torch.randint(0, CFG.vocab_size, (1, 3))
    out = generate(model, prompt, 0)
    assert torch.equal(out, prompt) and out is not prompt


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=-1), "max_new_tokens must be >= 0, got -1"),
        (dict(max_new_tokens=3, temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
        (dict(max_new_tokens=3, top_k=0), "top_k must be positive, got 0"),
        (dict(max_new_tokens=3, top_p=1.5), r"top_p must be a finite number in \(0, 1\], got 1.5"),
        (dict(max_new_tokens=3, eos_token_id=61), r"eos_token_id must be in \[0, 60\], got 61"),
    ],
)
def test_bad_arguments(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(model, torch.randint(0, CFG.vocab_size, (1, 4)), **kwargs)


def test_cache_overflow_is_an_error(model):
    cache = model.new_kv_cache(1, capacity=5)
    with torch.no_grad():
        model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="holds 5 tokens; 5 stored \\+ 1 new is too many"):
            model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match=r"capacity must be in \[1, context_length=40\], got 41"):
        model.new_kv_cache(1, capacity=41)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.int16, torch.int32])
def test_any_integer_prompt_dtype_continues_like_int64(model, dtype):
    # A uint16 np.memmap of a token file gives uint16 ids; the continuation is int64 (new ids may not fit).
    prompt = torch.randint(0, CFG.vocab_size, (2, 5))
    expected = greedy_without_cache(model, prompt, 6)
    got = generate(model, prompt.to(dtype), 6, temperature=0)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)
    assert torch.equal(generate(model, prompt.to(dtype), 0), prompt)


def test_out_of_vocabulary_prompts_are_refused(model):
    with pytest.raises(ValueError, match=r"prompt_ids must lie in \[0, vocab_size=61\), got values in \[-1, 3\]"):
        generate(model, torch.tensor([3, -1]), 2)
    with pytest.raises(ValueError, match=r"prompt_ids must lie in \[0, vocab_size=61\), got values in \[3, 61\]"):
        generate(model, torch.tensor([3, 61], dtype=torch.uint8), 2)
