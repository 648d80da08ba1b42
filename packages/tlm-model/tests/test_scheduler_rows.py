"""The Scheduler's rows (tlm_model.scheduler), without a server: an echoed prompt's scores against a float64
log-softmax of one plain forward, and a request in flight when a background warm-up's batch takes over, which
goes on as a cache-free greedy loop says it must. The compiler is faked (the eager model stands for the compiled
one), so nothing compiles here."""

import threading

import torch
from scheduler_parts import byte_model, byte_tokenizer

from tlm_model.scheduler import Request, Scheduler


def _scheduler(model, **options):
    return Scheduler(
        model, byte_tokenizer(), max_batch=2, max_queue=2, eos_ids=[], device=torch.device("cpu"), **options
    )


def _collect(pieces, done, wait_first=None):
    def emit(piece):
        if wait_first is not None and not pieces:
            wait_first()
        pieces.append(piece)
        if piece.finish_reason is not None:
            done.set()

    return emit


def test_an_echoed_prompt_has_every_tokens_log_probability_after_the_first():
    model, prompt = byte_model(), [97, 5, 200, 31, 64, 7]
    scheduler = _scheduler(model)
    pieces, done = [], threading.Event()
    try:
        scheduler.submit(Request(prompt=prompt, max_tokens=1, emit=_collect(pieces, done), temperature=0.0,
                                 logprobs=2, echo=True))  # fmt: skip
        assert done.wait(60)
    finally:
        scheduler.close(timeout=10)
    assert pieces[-1].finish_reason == "length"
    scored = pieces[0].prompt_scored
    assert [s.token for s in scored] == prompt and scored[0].logprob is None
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt]))[0].double(), dim=-1)
    for i, s in enumerate(scored[1:]):
        assert abs(s.logprob - logp[i, prompt[i + 1]].item()) < 1e-4
        assert [t for t, _ in s.top] == logp[i].topk(2).indices.tolist()


def test_a_request_in_flight_goes_on_in_the_batch_that_takes_over(monkeypatch):
    import tlm_model

    model, prompt, n = byte_model(), [97, 98, 99], 12
    monkeypatch.setattr(tlm_model, "compile_for_inference", lambda m: m)  # the eager model stands for the compiled
    scheduler = _scheduler(model)
    scheduler.compile_quiet_s, scheduler.compile_patience_s = 0.01, 0.0

    def until_warmed():  # the first token is out: hold the row here until the warmed batch waits to take over
        scheduler.compile_in_background()
        for _ in range(6000):
            if scheduler._warmed is not None:
                return
            threading.Event().wait(0.01)

    pieces, done = [], threading.Event()
    try:
        scheduler.submit(Request(prompt=prompt, max_tokens=n, emit=_collect(pieces, done, until_warmed),
                                 temperature=0.0, logprobs=0))  # fmt: skip
        assert done.wait(60)
        assert scheduler.engine_status()["engine"] == "compiled"
    finally:
        scheduler.close(timeout=10)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):  # greedy, each token from a forward over everything so far
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert pieces[-1].finish_reason == "length" and pieces[-1].error is None
    assert [s.token for p in pieces for s in p.scored] == ids[len(prompt) :]
