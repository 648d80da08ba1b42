"""``tlm_command.openai_api.protocol``'s own pieces, called directly (no server): a request body to a validated
request, or the 400 that names the field, what it expects and what came; the body's size bound; the prompts judged
too long for the context by their lengths before any tokenizing."""

import asyncio
import json

import pytest

pytest.importorskip("fastapi", reason="tlm serve needs the serve extra (fastapi, uvicorn)")

from tlm_command.openai_api.protocol import APIError, CompletionRequest, Limits, parse, read_body

#: A context of 64 tokens; a text prompt of more than 1000 characters cannot fit it (the server's bound).
LIMITS = Limits(model_name="m", context_length=64, vocab=257, max_chars=1000, max_body=100_000)


def _parse(body):
    return parse(json.dumps(body).encode(), CompletionRequest, LIMITS, capacity=8)


class _Request:
    """What read_body uses of a Starlette request: its headers and its body's chunks, counted as they are read."""

    def __init__(self, headers, chunks):
        self.headers, self.chunks, self.read = headers, chunks, 0

    async def stream(self):
        for chunk in self.chunks:
            self.read += 1
            yield chunk


def test_a_body_declared_too_large_is_refused_before_any_of_it_is_read():
    # RFC 9110's 413 (Content Too Large) may be answered on the Content-Length alone: a client that declares a
    # gigabyte is refused before the server waits for it, and none of it is read.
    request = _Request({"content-length": str(10**9)}, [b"x" * 10] * 3)
    with pytest.raises(APIError, match=r"the request body is over 20 bytes \(tlm serve --max-body\)") as caught:
        asyncio.run(read_body(request, max_body=20))
    assert (caught.value.status, caught.value.code, request.read) == (413, "request_too_large", 0)


def test_a_body_without_a_length_is_refused_as_it_comes_and_one_within_the_bound_is_read_whole():
    request = _Request({}, [b"x" * 10] * 3)  # chunked: no Content-Length; the third chunk passes 20 bytes
    with pytest.raises(APIError, match="over 20 bytes") as caught:
        asyncio.run(read_body(request, max_body=20))
    assert (caught.value.status, request.read) == (413, 3)
    request = _Request({"content-length": "20"}, [b"x" * 10, b"y" * 10])
    assert asyncio.run(read_body(request, max_body=20)) == b"x" * 10 + b"y" * 10


@pytest.mark.parametrize("prompt", ["x" * 1001, ["short", "x" * 1001]])
def test_a_text_prompt_longer_than_the_context_can_hold_is_refused_unread(prompt):
    # OpenAI's refusal of a prompt past the context (code context_length_exceeded), made here on the characters
    # alone: 1001 characters are more than max_chars, without tokenizing them.
    where = "prompt" if isinstance(prompt, str) else "prompt.1"
    with pytest.raises(APIError, match=rf"However, {where} has 1001 characters, more than 64 tokens can hold"):
        _parse({"prompt": prompt})
    assert _parse({"prompt": "x" * 1000}).prompt == "x" * 1000  # at the bound: left to the tokenizer


@pytest.mark.parametrize("nested", [False, True])
def test_a_prompt_of_exactly_the_context_fits_and_one_more_token_does_not(nested):
    # lm-evaluation-harness scores a whole window with max_tokens 0 and echo: a prompt of exactly the context's
    # 64 tokens fits it (OpenAI's "maximum context length is 64 tokens"), 65 do not, in a list of prompts too.
    def body(n):
        ids = list(range(n))
        return {"prompt": [ids] if nested else ids, "max_tokens": 0, "echo": True, "logprobs": 1}

    assert _parse(body(64)).max_tokens == 0
    with pytest.raises(APIError, match=r"maximum context length is 64 tokens. However, prompt(\.0)? has 65 tokens"):
        _parse(body(65))


@pytest.mark.parametrize(("field", "value"), [("temperature", "0.5"), ("max_tokens", "16"), ("echo", "true")])
def test_a_value_of_the_wrong_json_type_is_a_400_not_converted(field, value):
    # OpenAI's API takes numbers and booleans as JSON numbers and booleans: "0.5" is refused naming the field,
    # never read as 0.5 (a client sending strings is told so, not served as it did not ask).
    with pytest.raises(APIError, match=rf"^{field}: ") as caught:
        _parse({"prompt": "x", field: value})
    assert (caught.value.status, caught.value.param) == (400, field)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # A union field reports what its member of the right type refused, not "should be a valid string".
        (
            {"prompt": "x", "stop": ["a"] * 100_000},
            "stop: List should have at most 4 items after validation, not 100000",
        ),
        ({"prompt": [-1]}, "prompt.0: Input should be greater than or equal to 0"),
        ({"prompt": [[1], [-2]]}, "prompt.1.0: Input should be greater than or equal to 0"),
        ({"prompt": "x", "stop": [5]}, "stop.0: Input should be a valid string"),
        ({"prompt": None}, "prompt: Input should be a valid string"),  # no member takes it: the first one's words
        ({"prompt": "x", "max_tokens": "2"}, "max_tokens: Input should be a valid integer"),
    ],
)
def test_a_refused_field_is_named_with_what_it_expects(body, message):
    with pytest.raises(APIError) as info:
        _parse(body)
    assert (info.value.status, info.value.message) == (400, message)
