"""The HTTP side of ``tlm serve``: OpenAI's completions and chat completions API on FastAPI.

The wire format is OpenAI's, so its clients work unchanged: ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` as server-sent events of ``*.chunk`` objects, ending
with ``data: [DONE]``), ``GET /v1/models`` and ``GET /health``. Every error is OpenAI's error object
(``{"error": {"message", "type", "param", "code"}}``): 400 for malformed JSON, an unknown, mistyped or
unsupported field or a value out of range, 404 for another model's name, 413 for a body over ``max_body``
bytes, 429 with ``Retry-After`` when the queue is full, 503 with ``Retry-After`` while the server shuts down
or after the model failed, 500 for a request that failed inside the scheduler (alone: the others go on; a
stream gets an ``error`` event, then ``[DONE]``).

Every value is checked here, before any work, against what the scheduler can take: the body's size, then a
token-id prompt's length (before it is copied) and a text prompt's characters (before it is tokenized) against
the context, text that is not UTF-8 (a lone surrogate), the seed's range (``torch.Generator``'s), a temperature
below :data:`~tlm_model.sampling.GREEDY_BELOW` (greedy). Parsing, tokenizing and the chat template run in
worker threads, never on the event loop. Text from a request never becomes a special token: prompts and message
contents are encoded with ``allowed_special="none"``; only the chat template's own markers are special.

A prompt whose tokens plus ``max_tokens`` exceed the model's context is refused with 400
(``context_length_exceeded``), as OpenAI does; the server never slides a window, so every answer is
exactly what the model gives that prompt. ``max_tokens`` defaults to 16 for completions (OpenAI's
default) and to the rest of the context for chat. Scoring is OpenAI's legacy completions ``logprobs`` (the top
``k``, 0 to 20) and ``echo`` (the prompt's tokens scored too; ``max_tokens: 0`` scores without generating), and
chat's ``logprobs`` + ``top_logprobs``: log-probabilities of the model's logits in float32, before temperature,
penalties and bias. ``text_offset`` is each token's offset in the choice's ``text``, counting each token as the
text it decodes to alone.
"""

from tlm_command.openai_api.jobs import PLAIN_CHAT_STOP, TemplateError, chat_prompt_ids, plain_chat_prompt
from tlm_command.openai_api.protocol import (
    MAX_BODY,
    RETRY_AFTER_S,
    SEED_RANGE,
    UNSUPPORTED,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from tlm_command.openai_api.responses import chat_logprobs, legacy_logprobs
from tlm_command.openai_api.routes import create_app

__all__ = [
    "MAX_BODY",
    "PLAIN_CHAT_STOP",
    "RETRY_AFTER_S",
    "SEED_RANGE",
    "UNSUPPORTED",
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "TemplateError",
    "chat_logprobs",
    "chat_prompt_ids",
    "create_app",
    "legacy_logprobs",
    "plain_chat_prompt",
]
