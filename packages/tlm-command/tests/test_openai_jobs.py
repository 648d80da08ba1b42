"""The OpenAI-compatible API's requests turned into jobs (tlm_command.openai_api.jobs and .protocol), without a
server: what OpenAI's API reference documents for /v1/completions and /v1/chat/completions: ``max_tokens`` defaults
to 16 for a completion; a request past the context is a 400 whose error code is ``context_length_exceeded``; and
``user`` is an accepted field (an end-user id that changes nothing here)."""

import pytest

pytest.importorskip("pydantic", reason="tlm serve needs the serve extra")

from tlm_command.openai_api.jobs import completion_jobs, completion_prompts
from tlm_command.openai_api.protocol import APIError, ChatCompletionRequest, CompletionRequest, Limits

LIMITS = Limits(model_name="m", context_length=64, vocab=257, max_chars=1000, max_body=10_000)


def _jobs(body):
    from tlm_tokenizer import Tokenizer

    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    return completion_jobs(body, completion_prompts(body), tokenizer, [], LIMITS, capacity=8)[0]


def test_a_completion_without_max_tokens_generates_up_to_16():
    (job,) = _jobs(CompletionRequest.model_validate({"prompt": [1, 2, 3]}))
    assert job.max_tokens == 16
    (job,) = _jobs(CompletionRequest.model_validate({"prompt": [1, 2, 3], "max_tokens": 5}))
    assert job.max_tokens == 5


@pytest.mark.parametrize(("fields", "param"), [({"max_tokens": 62}, "max_tokens"), ({}, "prompt")])
def test_a_request_past_the_context_is_context_length_exceeded(fields, param):
    prompt = list(range(3)) if fields else list(range(50))  # 3 + 62 > 64; 50 + the default 16 > 64
    with pytest.raises(APIError) as caught:
        _jobs(CompletionRequest.model_validate({"prompt": prompt, **fields}))
    error = caught.value.body()["error"]
    assert (caught.value.status, error["type"], error["code"], error["param"]) == (
        400, "invalid_request_error", "context_length_exceeded", param,
    )  # fmt: skip


def test_the_user_field_is_accepted_in_both_requests():
    assert CompletionRequest.model_validate({"prompt": "x", "user": "u-1"}).user == "u-1"
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "user": "u-1"})
    assert chat.user == "u-1"
