"""Issue 41: a compiled scheduler never compiles while it serves, whatever the requests (dynamo's own counters).

A seeded random workload (prompts of 1 token up to the context, ``n`` choices, echo and log-probabilities,
``max_tokens`` 0 and 1, stop texts, sampled and greedy rows, clients that go away, rows joining and leaving at
any step) goes through a scheduler whose model was compiled and warmed up; dynamo's counters and a counting
backend (dynamo's graphs, no C++ build) must not move after the warm-up. Greedy answers are checked against
the eager model's ``generate`` alone, so the graphs that ran are the right ones.
"""

import random
import threading
import time

import torch

from tlm_model import ModelConfig, TransformerLM, generate

CFG = ModelConfig(vocab_size=61, context_length=40, d_model=32, num_layers=1, num_heads=4, d_ff=64)


class Letters:
    """A tokenizer stand-in: id ``i`` is the letter ``"abcdefghijklmnopqrstuvwxyz"[i % 26]``."""

    vocab_size = CFG.vocab_size

    def decode_bytes(self, ids):
        return bytes(97 + i % 26 for i in ids)


def _unset(piece) -> None:  # each request's emit until the test gives it its own
    raise AssertionError("emit was not set")


def _workload(rng, count):
    """(requests to submit together, the pause before them) in arrival order: ``count`` requests in all."""
    from tlm_model.scheduler import Request

    waves, made = [], 0
    while made < count:
        length = rng.choice([1, 1, 2, 3, rng.randint(1, CFG.context_length - 1), CFG.context_length - 1])
        kind = rng.choice(["generate", "generate", "score", "one", "echo"])
        max_tokens = {"score": 0, "one": 1}.get(kind, rng.randint(2, 9))
        max_tokens = min(max_tokens, CFG.context_length - length) if kind != "score" else 0
        echo = kind in ("score", "echo")
        prompt = [rng.randrange(CFG.vocab_size) for _ in range(length)]
        n = rng.choice([1, 1, 1, 2, 3])
        wave = []
        for choice in range(n):
            wave.append(Request(
                prompt=prompt, max_tokens=max_tokens, emit=_unset, temperature=rng.choice([0.0, 0.0, 0.8]),
                seed=rng.randrange(1000) + choice, stop=rng.choice([[], [], ["q"], ["ab", "z"]]),
                logprobs=rng.choice([None, None, 0, 3]), echo=echo,
            ))  # fmt: skip
        made += n
        waves.append((wave, rng.choice([0.0, 0.0, 0.01, 0.05]), rng.random() < 0.15))
    return waves


def test_a_random_workload_compiles_nothing_after_the_warm_up(recorded_graphs):
    # ~20 s: dynamo traces the 1-layer model three times (steps of 1 row and of more, prompt chunks).
    from torch._dynamo.utils import counters

    from tlm_model import compile_for_inference
    from tlm_model.scheduler import Scheduler

    graphs = recorded_graphs
    counters.clear()
    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    scheduler = Scheduler(compile_for_inference(model), Letters(), max_batch=4, max_queue=64, eos_ids=[],
                          device=torch.device("cpu"), warm_up=True, prefill_chunk=8, token_budget=16)  # fmt: skip
    warm_graphs, warm_unique = len(graphs), counters["stats"]["unique_graphs"]
    assert warm_graphs == warm_unique == 3  # the step at 1 row, at every other bucket, and prompt chunks

    rng = random.Random(41)
    waves = _workload(rng, 60)
    answers = []  # per request: (request, tokens, finish reason)

    def listen(request, cancel):
        answer = {"tokens": [], "finish": None, "done": threading.Event()}

        def emit(piece):
            answer["tokens"].extend(s.token for s in piece.scored)
            answer["text"] = answer.get("text", "") + piece.text
            if cancel and piece.finish_reason is None:
                request.cancelled.set()  # the client went away after its first piece
            if piece.finish_reason is not None:
                answer["finish"] = piece.finish_reason
                answer["done"].set()

        request.emit = emit
        answers.append((request, answer, cancel))

    for wave, pause, cancel in waves:
        for request in wave:
            listen(request, cancel)
        time.sleep(pause)
        scheduler.submit_all(wave)
    for _, answer, cancel in answers:  # a request whose client went away gets no last piece
        assert cancel or answer["done"].wait(timeout=120)
    assert scheduler.close(timeout=60)
    assert len(graphs) == warm_graphs and counters["stats"]["unique_graphs"] == warm_unique
    assert scheduler.steps > 10
    lengths = {len(r.prompt) for r, _, _ in answers}
    assert 1 in lengths and max(lengths) >= CFG.context_length - 1
    for request, answer, cancel in answers:
        assert answer["finish"] in ("stop", "length") or cancel, answer
        if request.temperature == 0 and not cancel and request.max_tokens and not request.stop:
            expected = generate(model, torch.tensor(request.prompt), request.max_tokens, temperature=0)
            text = "".join(chr(97 + int(i) % 26) for i in expected[len(request.prompt) :])
            assert answer["text"] == text, request
    torch._dynamo.reset()
