"""``tlm_command.openai_api.protocol.parse``: a request body to a validated request, or the 400 that names the field,
what it expects and what came; called directly (no server)."""

import json

import pytest

pytest.importorskip("fastapi", reason="tlm serve needs the serve extra (fastapi, uvicorn)")

from tlm_command.openai_api.protocol import APIError, CompletionRequest, Limits, parse

LIMITS = Limits("tiny", context_length=64, vocab=300, max_chars=64 * 8, max_body=1 << 20)


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
        parse(json.dumps(body).encode(), CompletionRequest, LIMITS, capacity=8)
    assert (info.value.status, info.value.message) == (400, message)
