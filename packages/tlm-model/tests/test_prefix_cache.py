"""The serving engine's prefix cache (``DecodeBatch(prefix_rows=...)``, ``Scheduler(prefix_cache=True)``): a prompt
that shares a prefix with one the cache holds runs only the rest, and every answer equals the one computed
without it: log-probabilities against the model's own float64 forward, greedy texts against ``generate``."""

import copy
import random
import threading

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM, generate
from tlm_model.batching import DecodeBatch
from tlm_model.scheduler import Request, Scheduler

CFG = ModelConfig(vocab_size=61, context_length=48, d_model=32, num_layers=2, num_heads=4, d_ff=64)


class CountingLM(TransformerLM):
    """Counts the real tokens its forwards run (a padding token sits at the scratch slot, the capacity)."""

    run_tokens = 0

    def forward_static(self, in_indices, positions, kv_cache, *args, **kwargs):
        self.run_tokens += int((positions < kv_cache.capacity).sum())
        return super().forward_static(in_indices, positions, kv_cache, *args, **kwargs)


def _model():
    torch.manual_seed(0)
    return CountingLM(CFG).eval()


def _ids(*values):
    return torch.tensor(values, dtype=torch.int64)


def _last_logits(model, prompt):
    """The model's own next-token logits after ``prompt``, one full forward without any cache."""
    with torch.no_grad():
        return model(prompt[None])[0, -1]


def _prefill(batch, prompt):
    """Join ``prompt`` and run its chunks (the last row); its next-token logits."""
    row = batch.join(prompt)
    return batch.run(None, {row: len(prompt) - batch.lengths[row]})[row][-1]


def test_a_prompt_sharing_a_kept_prefix_runs_only_the_rest_and_gets_the_same_logits():
    model = _model()
    batch = DecodeBatch(model, 2, prefix_rows=1)
    context = _ids(5, 9, 2, 33, 7, 7, 1, 40)
    _prefill(batch, context)
    batch.remove(0)  # its row is free; its keys and values stay
    for tail in ([3, 4], [8]):
        prompt = torch.cat([context, _ids(*tail)])
        before = model.run_tokens
        logits = _prefill(batch, prompt)
        assert model.run_tokens - before == len(tail)  # the context came from the cache
        torch.testing.assert_close(logits, _last_logits(model, prompt), atol=1e-5, rtol=1e-5)
        batch.remove(0)
    before = model.run_tokens
    logits = _prefill(batch, context)  # the whole prompt is cached: its last token still runs
    assert model.run_tokens - before == 1
    torch.testing.assert_close(logits, _last_logits(model, context), atol=1e-5, rtol=1e-5)
    assert batch.reused_tokens == 2 * len(context) + len(context) - 1


def test_a_row_taken_by_another_prompt_lends_only_what_it_still_holds():
    model = _model()
    batch = DecodeBatch(model, 1, prefix_rows=0)  # one cache row: each prompt overwrites the last
    first, second = _ids(4, 8, 15, 16, 23, 42, 7), _ids(4, 8, 15, 50, 51)
    for prompt, reused in ((first, 0), (second, 3), (first, 3), (_ids(9, 9), 0), (first, 0)):
        before, held = model.run_tokens, batch.reused_tokens
        logits = _prefill(batch, prompt)
        assert (batch.reused_tokens - held, model.run_tokens - before) == (reused, len(prompt) - reused)
        torch.testing.assert_close(logits, _last_logits(model, prompt), atol=1e-5, rtol=1e-5)
        batch.remove(0)


def test_kept_prompts_move_to_the_least_recently_used_spare_row():
    model = _model()
    batch = DecodeBatch(model, 1, prefix_rows=2)  # the row in use and two that only keep prompts
    prompts = [_ids(10 + i, 1, 2, 3, 4) for i in range(4)]
    for prompt in prompts:  # each leaves before the next: the first is evicted when the fourth joins
        _prefill(batch, prompt)
        batch.remove(0)
    for prompt, reused in ((prompts[3], 4), (prompts[1], 4), (prompts[2], 4), (prompts[0], 0)):
        held = batch.reused_tokens
        logits = _prefill(batch, prompt)
        assert batch.reused_tokens - held == reused
        torch.testing.assert_close(logits, _last_logits(model, prompt), atol=1e-5, rtol=1e-5)
        batch.remove(0)


def test_a_prompt_waits_for_a_running_prompt_it_shares_more_with_then_takes_its_prefix():
    model = _model()
    batch = DecodeBatch(model, 3, prefill_chunk=4, prefix_rows=0)
    context = _ids(*range(20, 30))
    lead = batch.join(context, wait=True)
    follow = batch.join(torch.cat([context, _ids(2, 3)]), wait=True)
    other = batch.join(_ids(1, 2), wait=True)  # nothing to share: runs at once
    assert batch.waiting == (follow,) and batch.lengths == (0, 0, 0)
    with pytest.raises(ValueError, match="chunks must name prefilling rows"):
        batch.run(None, {follow: 1})
    batch.run(None, {lead: 4, other: 2})
    batch.settle()
    assert batch.waiting == (follow,)  # 4 of the 10 shared tokens have run
    batch.run(None, {lead: 6})
    batch.settle()
    assert batch.waiting == () and batch.lengths == (10, 10, 2) and batch.reused(follow) == (10, None)
    logits = batch.run(None, {follow: 2})[follow][-1]
    torch.testing.assert_close(logits, _last_logits(model, torch.cat([context, _ids(2, 3)])), atol=1e-5, rtol=1e-5)


def _float64_scores(model, prompt, top):
    """(each prompt token's log-probability, its ``top`` best ids) from the model's own float64 forward."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor(prompt)[None])[0].double(), dim=-1)
    picked = logp[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return picked.tolist(), logp[:-1].topk(top, dim=-1).indices.tolist()


def _serve(model, waves, prefix_cache):
    """Run ``waves`` of (prompt, kind, n) through a scheduler; per request (its prompt scores, its text)."""
    scheduler = Scheduler(model, Letters(), max_batch=4, max_queue=256, eos_ids=[], device=torch.device("cpu"),
                          prefill_chunk=8, token_budget=16, prefix_cache=prefix_cache)  # fmt: skip
    answers = []
    for wave in waves:
        requests = []
        for prompt, kind, n in wave:
            for choice in range(n):
                answer = {"text": "", "scored": None, "done": threading.Event()}

                def emit(piece, answer=answer):
                    answer["text"] += piece.text
                    answer["scored"] = piece.prompt_scored if piece.prompt_scored else answer["scored"]
                    if piece.finish_reason is not None:
                        answer["finish"] = piece.finish_reason
                        answer["done"].set()

                echo = kind.startswith("score")
                requests.append(Request(
                    prompt=prompt, emit=emit, max_tokens={"score0": 0, "score1": 1}.get(kind, 5), temperature=0.0,
                    logprobs=2 if echo else None, echo=echo, seed=choice,
                ))  # fmt: skip
                answers.append((prompt, kind, answer))
        scheduler.submit_all(requests)
    for _, _, answer in answers:
        assert answer["done"].wait(timeout=60)
    reused = scheduler.batch.reused_tokens
    assert scheduler.close(timeout=10)
    return answers, reused


class Letters:
    vocab_size = CFG.vocab_size

    def decode_bytes(self, ids):
        return bytes(97 + i % 26 for i in ids)


def test_a_random_workload_with_shared_prefixes_answers_as_without_the_cache():
    # lm-eval's shape (choices of a question share its context; echo, max_tokens 0 or 1) mixed with greedy
    # generations and n > 1, arriving in waves: the log-probabilities equal the model's own float64 forward's and
    # the ones computed without the cache, the texts equal generate's, and the cache did take prompt tokens.
    model = _model()
    rng = random.Random(7)
    contexts = [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    waves = []
    for _ in range(8):
        wave = []
        for _ in range(rng.randint(1, 6)):
            tail = [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(0, 6))]
            prompt = (rng.choice(contexts) + tail) or [3]
            wave.append((prompt, rng.choice(["score0", "score1", "score1", "generate"]), rng.choice([1, 1, 2])))
        waves.append(wave)
    answers, reused = _serve(model, waves, prefix_cache=True)
    plain, none = _serve(model, waves, prefix_cache=False)
    assert reused > 100 and none == 0
    worst = 0.0
    for (prompt, kind, answer), (_, _, alone) in zip(answers, plain, strict=True):
        assert answer["finish"] == "length"
        if kind == "generate":
            expected = generate(model, torch.tensor(prompt), 5, temperature=0)[len(prompt) :]
            assert answer["text"] == alone["text"] == "".join(chr(97 + int(i) % 26) for i in expected)
            continue
        picked, best = _float64_scores(copy.deepcopy(model).double(), prompt, 2)
        scored = answer["scored"]
        assert [s.token for s in scored] == prompt and scored[0].logprob is None
        assert [[i for i, _ in s.top] for s in scored[1:]] == best
        got = torch.tensor([s.logprob for s in scored[1:]], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(picked, dtype=torch.float64), atol=2e-5, rtol=0)
        without = torch.tensor([s.logprob for s in alone["scored"][1:]], dtype=torch.float64)
        worst = max([worst, *(got - without).abs().tolist()])
    print(f"reused {reused} prompt tokens; largest difference from scoring without the cache: {worst:.2e}")
    assert worst < 1e-5  # float32 rounding of another chunk split (measured: about 1e-6)


def test_rows_leaving_together_keep_their_prompts_as_leaving_one_by_one_would():
    model = _model()
    batch = DecodeBatch(model, 5, prefix_rows=0)
    prompts = [_ids(30 + r, *range(r + 2)) for r in range(5)]
    batch.add_many(prompts)
    assert batch.remove_many([3, 1]) == [0, 4, 2]  # as remove(3) then remove(1): the last row fills each place
    assert batch.lengths == (3, 7, 5) and batch.prefilling == ()
    for prompt in (prompts[1], prompts[3], prompts[4]):  # the ones that left and one still in use
        held = batch.reused_tokens
        logits = _prefill(batch, prompt)
        assert batch.reused_tokens - held == len(prompt) - 1
        torch.testing.assert_close(logits, _last_logits(model, prompt), atol=1e-5, rtol=1e-5)
        batch.remove(len(batch) - 1)


def test_an_engine_taking_over_the_rows_takes_over_the_kept_prompts():
    model = _model()
    eager, other = DecodeBatch(model, 2, prefix_rows=1), DecodeBatch(model, 2, prefix_rows=1)
    context = _ids(7, 3, 9, 11, 2)
    _prefill(eager, context)
    eager.remove(0)
    other.take_over(eager)
    prompt = torch.cat([context, _ids(5)])
    before = model.run_tokens
    logits = _prefill(other, prompt)
    assert model.run_tokens - before == 1 and other.reused_tokens == len(context)
    torch.testing.assert_close(logits, _last_logits(model, prompt), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="source must have prefix_rows=None, got 1"):
        DecodeBatch(model, 2, capacity=eager.capacity).take_over(eager)
