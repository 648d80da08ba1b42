"""``generate``: cached decoding, sampling filters, stopping, streaming and argument checks.

Expected values come from the float64 re-derivation of the LM in conftest.py (torch built-ins
only), from uncached greedy decoding with full forwards, or from closed-form sampling statistics
with fixed seeds.
"""

import dataclasses

import pytest
import torch

from tlm_attention import BACKENDS
from tlm_model import ModelConfig, TransformerLM, generate
from tlm_model.generate import EOS_CHECK_EVERY, _filter_logits, sample_tokens

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
    # The prompt once (its 7 tokens in two rows of 4, DecodeBatch's chunk grid), then one new token per step
    # (the last is not fed back).
    assert seen == [4, 1, 1, 1, 1]


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


def _float64_lm_logits(model, ids, lm_reference):
    return lm_reference(model.state_dict(), ids, model.config)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_right_after_a_one_token_prompt_continues_rope_positions(backend, lm_reference, record_error):
    # After a one-token prefill the cache holds 1 token, so the next token sits at position 1, not 0.
    model = TransformerLM(CFG, attention_backend=backend).eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 4))
    expected = _float64_lm_logits(model, ids, lm_reference)
    with torch.no_grad():
        cache = model.new_kv_cache(2)
        steps = [model(ids[:, t : t + 1], kv_cache=cache) for t in range(4)]
    got = torch.cat(steps, dim=1)
    record_error("one-token-prompt decode vs float64 LM", got, expected)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_greedy_generation_from_a_one_token_prompt_matches_uncached_decoding(model, lm_reference):
    prompt = torch.randint(0, CFG.vocab_size, (3, 1))
    ids = prompt
    for _ in range(6):  # uncached greedy decoding on the float64 reference
        ids = torch.cat([ids, _float64_lm_logits(model, ids, lm_reference)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generate(model, prompt, 6, temperature=0), ids)


def _sharp_model(vocab=8):
    """A model whose next-token distribution is far from uniform, so that temperature matters."""
    cfg = ModelConfig(vocab_size=vocab, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)  # logits of a few units: neither flat nor one-hot
    return model


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_frequencies_follow_softmax_of_logits_over_temperature(temperature, lm_reference):
    model = _sharp_model()
    rows = 20_000
    prompt = torch.tensor([3, 1, 4])
    logits = _float64_lm_logits(model, prompt.unsqueeze(0), lm_reference)[0, -1]
    expected = torch.softmax(logits / temperature, -1)
    out = generate(
        model, prompt.expand(rows, -1), 1, temperature=temperature, generator=torch.Generator().manual_seed(0)
    )
    freq = torch.bincount(out[:, -1], minlength=model.config.vocab_size).double() / rows
    # Each frequency has standard error sqrt(p(1-p)/rows) <= 0.0036; 5 of them is a fixed-seed bound.
    bound = 5 * torch.sqrt(expected * (1 - expected) / rows) + 1e-3
    assert ((freq - expected).abs() <= bound).all(), (freq, expected)
    # The temperatures give clearly different distributions, so the test tells them apart.
    for other in (0.5, 1.0, 2.0):
        if other != temperature:
            assert (torch.softmax(logits / other, -1) - expected).abs().max() > 4 * bound.max()


def test_generation_stops_once_every_row_has_emitted_eos(model, lm_reference):
    # Find two prompts whose uncached greedy continuations share a token, emitted at different steps.
    steps, found = 14, None
    for seed in range(50):
        prompt = torch.randint(0, CFG.vocab_size, (2, 3), generator=torch.Generator().manual_seed(seed))
        ids = prompt
        for _ in range(steps):
            nxt = _float64_lm_logits(model, ids, lm_reference)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        new = ids[:, 3:]
        for token in set(new[0].tolist()) & set(new[1].tolist()):
            first = [int((new[r] == token).nonzero()[0]) for r in range(2)]
            if first[0] != first[1] and max(first) < steps - 2:
                found = prompt, new, token, first
                break
        if found:
            break
    assert found, "no prompt pair with a shared greedy token: enlarge the search"
    prompt, new, eos, first = found
    calls = []
    hook = model.token_embeddings.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[-1]))
    try:
        out = generate(model, prompt, steps, temperature=0, eos_token_id=eos)
    finally:
        hook.remove()
    last = max(first)
    assert out.shape == (2, 3 + last + 1)  # stops at the step where the later row emits eos
    for r in range(2):
        assert torch.equal(out[r, 3 : 3 + first[r] + 1], new[r, : first[r] + 1])
        assert (out[r, 3 + first[r] :] == eos).all()  # a finished row is padded with eos
    # Nothing after the last row finished is returned; the loop asks the device whether every row has ended
    # once every EOS_CHECK_EVERY steps, so it may run a few forwards past it (on_token: none, see below).
    assert calls[: last + 1] == [3] + [1] * last and len(calls) < last + 1 + EOS_CHECK_EVERY
    calls.clear()
    hook = model.token_embeddings.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[-1]))
    try:
        streamed = generate(model, prompt, steps, temperature=0, eos_token_id=eos, on_token=lambda ids: None)
    finally:
        hook.remove()
    assert torch.equal(streamed, out) and calls == [3] + [1] * last  # read every step: no forward past the end


def test_generation_runs_to_max_new_tokens_when_no_row_emits_eos(model):
    prompt = torch.randint(0, CFG.vocab_size, (2, 3))
    greedy = generate(model, prompt, 8, temperature=0)
    unused = next(t for t in range(CFG.vocab_size) if t not in greedy[:, 3:].tolist()[0] + greedy[:, 3:].tolist()[1])
    assert torch.equal(generate(model, prompt, 8, temperature=0, eos_token_id=unused), greedy)


def test_cached_generation_in_bfloat16_matches_the_float64_model(model, lm_reference):
    model = model.to(torch.bfloat16)
    prompt = torch.randint(0, CFG.vocab_size, (2, 5))
    cache = model.new_kv_cache(2)
    assert all(b.dtype == torch.bfloat16 for b in (*cache.key_buffers, *cache.value_buffers))
    ids = torch.randint(0, CFG.vocab_size, (2, 12))
    expected = _float64_lm_logits(model, ids, lm_reference)  # the bf16 weights, evaluated in float64
    with torch.no_grad():
        steps = [model(ids[:, :5], kv_cache=cache)] + [model(ids[:, t : t + 1], kv_cache=cache) for t in range(5, 12)]
    got = torch.cat(steps, dim=1)
    assert got.dtype == torch.bfloat16
    # bf16 keeps 8 mantissa bits; through 2 layers the logits (|l| ~ 3) stay within a few bf16 steps.
    torch.testing.assert_close(got.double(), expected, rtol=0.05, atol=0.1)
    out = generate(model, prompt, 10, temperature=0.7, top_k=20, generator=torch.Generator().manual_seed(1))
    assert out.shape == (2, 15) and out.dtype == prompt.dtype
    assert ((out >= 0) & (out < CFG.vocab_size)).all()
    assert torch.equal(out[:, :5], prompt)


def test_sampling_in_bfloat16_uses_float32_probabilities():
    # Sampling from bf16 logits gives the float32 softmax's distribution: the exponential race's winner
    # argmax(p / E) re-derived in float32 from the same generator's Exp(1) draws.
    model = _sharp_model()
    prompt = torch.tensor([[3, 1, 4]]).expand(64, -1)
    bf16 = model.to(torch.bfloat16)
    out = generate(bf16, prompt, 1, temperature=0.9, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = bf16(prompt)[:, -1].float() / 0.9
    noise = torch.empty(logits.shape).exponential_(generator=torch.Generator().manual_seed(5))
    expected = (torch.softmax(logits, -1) / noise).argmax(-1, keepdim=True)
    assert torch.equal(out[:, -1:], expected)


@pytest.mark.parametrize("extra", [0, 1, 100])
def test_top_k_at_or_above_the_vocabulary_keeps_every_token(extra):
    logits = torch.randn(3, 11)
    torch.testing.assert_close(_filter_logits(logits, 11 + extra, None), logits, rtol=0, atol=0)


def test_top_k_above_the_vocabulary_samples_like_no_top_k(model):
    prompt = torch.randint(0, CFG.vocab_size, (2, 4))
    plain = generate(model, prompt, 6, generator=torch.Generator().manual_seed(2))
    big_k = generate(model, prompt, 6, top_k=10 * CFG.vocab_size, generator=torch.Generator().manual_seed(2))
    assert torch.equal(plain, big_k)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_top_k_keeps_exactly_the_k_largest(k):
    logits = torch.randn(4, 13, dtype=torch.float64)
    kept = torch.isfinite(_filter_logits(logits, k, None))
    expected = torch.zeros_like(kept).scatter(-1, torch.topk(logits, k, dim=-1).indices, True)
    assert torch.equal(kept, expected)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_keeps_the_smallest_prefix_reaching_p(p):
    logits = torch.randn(5, 17, dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    kept = torch.isfinite(_filter_logits(logits, None, p))
    for row in range(5):
        order = probs[row].argsort(descending=True).tolist()
        total, keep = 0.0, set()
        for token in order:  # closed-form rule, written as a loop
            keep.add(token)
            total += probs[row, token].item()
            if total >= p:
                break
        assert set(kept[row].nonzero().flatten().tolist()) == keep


def test_top_p_of_one_keeps_every_token():
    logits = torch.randn(2, 9)
    assert torch.isfinite(_filter_logits(logits, None, 1.0)).all()


def test_filtered_sampling_never_draws_a_dropped_token():
    model = _sharp_model()
    prompt = torch.tensor([[3, 1, 4]]).expand(2_000, -1)
    with torch.no_grad():
        logits = model(prompt[:1])[0, -1]
    allowed = set(torch.topk(logits, 2).indices.tolist())
    out = generate(model, prompt, 1, temperature=5.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(out[:, -1].tolist()) == allowed


def test_on_token_receives_each_new_token_as_it_comes(model):
    seen = []
    out = generate(model, torch.randint(0, CFG.vocab_size, (2, 3)), 5, temperature=0, on_token=seen.append)
    assert torch.equal(torch.stack(seen, dim=1), out[:, 3:])
    one = []
    out = generate(model, torch.randint(0, CFG.vocab_size, (3,)), 4, temperature=0, on_token=one.append)
    assert [t.shape for t in one] == [()] * 4 and [int(t) for t in one] == out[3:].tolist()


def test_on_token_returning_true_stops_generation(model):
    calls = []

    def stop_at_third(ids):
        calls.append(ids)
        return len(calls) == 3

    out = generate(model, torch.randint(0, CFG.vocab_size, (1, 3)), 10, temperature=0, on_token=stop_at_third)
    assert out.shape == (1, 6) and len(calls) == 3


def test_generate_does_not_modify_the_prompt(model):
    prompt = torch.randint(0, CFG.vocab_size, (2, 3))
    before = prompt.clone()
    generate(model, prompt, 4, temperature=1.0)
    assert torch.equal(prompt, before)


def greedy_sliding_reference(model, prompt, n):
    """The documented window rule, recomputed without a cache: the model sees tokens[start:]; once that is
    longer than the context, start jumps so that the newest context - context // 4 tokens remain."""
    context = model.config.context_length
    keep = context - max(1, context // 4)
    tokens = prompt.tolist()
    start = 0 if len(tokens) <= context else len(tokens) - keep
    with torch.no_grad():
        for _ in range(n):
            if len(tokens) - start > context:
                start = len(tokens) - keep
            tokens.append(int(model(torch.tensor([tokens[start:]]))[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize(("prompt_len", "new"), [(35, 5), (36, 5), (40, 1), (10, 75), (52, 30)])
def test_generation_longer_than_the_context_slides_the_window(model, prompt_len, new):
    prompt = torch.randint(0, CFG.vocab_size, (prompt_len,))
    out = generate(model, prompt, new, temperature=0)
    assert out.shape == (prompt_len + new,)
    assert out.tolist() == greedy_sliding_reference(model, prompt, new)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0, got nan"),
        (dict(temperature=float("inf")), ValueError, "temperature must be a finite number >= 0, got inf"),
        (dict(top_k=True), TypeError, r"top_k must be an int, got bool \(True\)"),
        (dict(top_k=2.0), TypeError, r"top_k must be an int, got float \(2.0\)"),
        (dict(top_p=0.0), ValueError, r"top_p must be a finite number in \(0, 1\], got 0.0"),
        (dict(top_p=-0.1), ValueError, r"top_p must be a finite number in \(0, 1\], got -0.1"),
        (dict(eos_token_id=True), TypeError, "eos_token_id must be a token id, a non-empty sequence of them"),
        (dict(eos_token_id=[]), TypeError, "eos_token_id must be a token id, a non-empty sequence of them"),
        (dict(eos_token_id=[1, -2]), ValueError, r"eos_token_id must be in \[0, 60\], got -2"),
    ],
)
def test_more_bad_sampling_arguments(model, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        generate(model, torch.randint(0, CFG.vocab_size, (1, 4)), 3, **kwargs)


@pytest.mark.parametrize("bad", [True, 2.0, "3"])
def test_max_new_tokens_must_be_an_int(model, bad):
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        generate(model, torch.randint(0, CFG.vocab_size, (1, 4)), bad)


@pytest.mark.parametrize("prompt", [torch.zeros(1, 0, dtype=torch.long), torch.zeros((), dtype=torch.long)])
def test_empty_and_scalar_prompts_are_refused(model, prompt):
    with pytest.raises(ValueError, match="prompt_ids must be a non-empty tensor of shape"):
        generate(model, prompt, 3)


@pytest.mark.parametrize("bad", ["hot", None, [1.0]])
def test_temperature_of_the_wrong_type_is_a_type_error(model, bad):
    with pytest.raises(TypeError, match="temperature must be a number, got"):
        generate(model, torch.randint(0, CFG.vocab_size, (1, 4)), 3, temperature=bad)


def test_zero_new_tokens_never_runs_the_model(model):
    calls = []
    hook = model.token_embeddings.register_forward_hook(lambda m, args, out: calls.append(1))
    try:
        out = generate(model, torch.randint(0, CFG.vocab_size, (2, 3)), 0)
    finally:
        hook.remove()
    assert calls == [] and out.shape == (2, 3)


def _left_padded(prompts, pad=0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = p
    return ids, [len(p) for p in prompts]


@pytest.mark.parametrize(("backend", "kv_heads"), [*((b, None) for b in BACKENDS), ("reference", 2), ("torch", 2)])
def test_each_row_of_a_ragged_batch_decodes_as_its_prompt_alone_and_as_full_recompute(backend, kv_heads):
    cfg = CFG if kv_heads is None else dataclasses.replace(CFG, num_kv_heads=kv_heads)
    model = TransformerLM(cfg, attention_backend=backend).eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in (1, 7, 3, 12)]
    ids, lengths = _left_padded(prompts, pad=CFG.vocab_size - 1)
    out = generate(model, ids, 20, temperature=0, prompt_lengths=lengths)
    assert torch.equal(out[:, : ids.shape[1]], ids)  # the padding comes back as it came
    for b, prompt in enumerate(prompts):
        alone = generate(model, prompt, 20, temperature=0)
        with torch.no_grad():
            recomputed = greedy_without_cache(model, prompt.unsqueeze(0), 20)[0]  # independent of any cache
        assert torch.equal(alone, recomputed)
        assert torch.equal(out[b, ids.shape[1] - len(prompt) :], alone)


def test_ragged_rows_past_the_context_slide_each_on_its_own_like_their_prompt_alone(model):
    # 1 + 60 tokens overflow a 40-token context; 30 + 60 too, and a 45-token prompt starts past it.
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in (1, 30, 45)]
    ids, lengths = _left_padded(prompts)
    out = generate(model, ids, 60, temperature=0, prompt_lengths=lengths)
    for b, prompt in enumerate(prompts):
        assert torch.equal(out[b, ids.shape[1] - len(prompt) :], generate(model, prompt, 60, temperature=0))


@pytest.mark.parametrize(
    ("lengths", "exc", "match"),
    [([3], ValueError, r"prompt_lengths must hold one int per row \(2\), got 1"),
     ([3, 0], ValueError, r"prompt_lengths must be in \[1, 4\], got 0"),
     ([3, 5], ValueError, r"prompt_lengths must be in \[1, 4\], got 5"),
     ([3, 2.0], TypeError, "prompt_lengths must be an int, got float"),
     (3, TypeError, "prompt_lengths must be a sequence of ints, one per row, got int")],
)  # fmt: skip
def test_bad_prompt_lengths_are_refused(model, lengths, exc, match):
    with pytest.raises(exc, match=match):
        generate(model, torch.zeros(2, 4, dtype=torch.long), 2, prompt_lengths=lengths)


def test_ragged_rows_in_a_two_token_context_slide_like_their_prompt_alone_and_the_window_rule():
    # context 2 keeps 2 - max(1, 2 // 4) = 1 token when it slides: a full row is rebuilt from the 0 tokens before
    # the one it is about to take, the edge of the window rule.
    cfg = dataclasses.replace(CFG, context_length=2)
    model = TransformerLM(cfg).eval()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in (1, 2, 3)]
    ids, lengths = _left_padded(prompts)
    out = generate(model, ids, 5, temperature=0, prompt_lengths=lengths)
    for b, prompt in enumerate(prompts):
        alone = generate(model, prompt, 5, temperature=0)
        assert alone.tolist() == greedy_sliding_reference(model, prompt, 5)
        assert torch.equal(out[b, ids.shape[1] - len(prompt) :], alone)


# Batched sampling (issue 34): one call for every row, each with its own settings and generator.
def test_sample_tokens_gives_each_seeded_row_the_tokens_it_gets_alone():
    logits = torch.randn(4, 23, generator=torch.Generator().manual_seed(0))
    settings = dict(temperature=[0.7, 0.0, 1.3, 1.0], top_k=[None, 3, 5, 0], top_p=[0.9, None, 1.0, 0.5])
    seeds = [11, 12, None, 13]

    def generators(rows):
        return [None if seeds[r] is None else torch.Generator().manual_seed(seeds[r]) for r in rows]

    together = sample_tokens(logits, **settings, generators=generators(range(4)))
    for r in (0, 1, 3):  # the seeded rows and the greedy one: alone, and in another batch order
        alone = sample_tokens(logits[r : r + 1], **{k: v[r : r + 1] for k, v in settings.items()},
                              generators=generators([r]))  # fmt: skip
        order = [r, *[o for o in range(4) if o != r]][::-1]
        shuffled = sample_tokens(logits[order], **{k: [v[o] for o in order] for k, v in settings.items()},
                                 generators=generators(order))  # fmt: skip
        assert together[r] == alone[0] == shuffled[order.index(r)], r
    assert together[1] == logits[1].argmax()


def test_sample_tokens_keeps_to_each_rows_own_limits_and_distribution():
    # 3 rows x 4,000 draws: row 0 may only draw its 2 most likely tokens, row 1 the smallest set reaching 0.6,
    # row 2 any token with softmax(logits / 2) frequencies (5 standard errors, fixed seed).
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 9, generator=gen, dtype=torch.float64)
    draws = 4_000
    rows = logits.repeat_interleave(draws, 0)
    out = sample_tokens(rows, [2.0] * draws + [1.0] * draws + [2.0] * draws, [2] * draws + [None] * 2 * draws,
                        [None] * draws + [0.6] * draws + [None] * draws, gen).view(3, draws)  # fmt: skip
    assert set(out[0].tolist()) == set(torch.topk(logits[0], 2).indices.tolist())
    probs = torch.softmax(logits[1], -1)
    ranked, total, nucleus = probs.argsort(descending=True).tolist(), 0.0, set()
    for token in ranked:  # the closed-form rule, as a loop
        nucleus.add(token)
        total += probs[token].item()
        if total >= 0.6:
            break
    assert set(out[1].tolist()) == nucleus
    expected = torch.softmax(logits[2] / 2.0, -1)
    freq = torch.bincount(out[2], minlength=9).double() / draws
    assert ((freq - expected).abs() <= 5 * torch.sqrt(expected * (1 - expected) / draws) + 1e-3).all()
