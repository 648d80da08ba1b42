"""The request side of the wire format: OpenAI's request bodies as strict pydantic models, the error object, and
:func:`parse`, which turns a body's bytes into a validated request or the :class:`APIError` that refuses it (size
bounds first, before any copy or tokenizing)."""

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from tlm_tokenizer.chat import CHAT_ROLES

#: How long a client is told to wait before retrying a full or closing server (the Retry-After header).
RETRY_AFTER_S = 1
#: The request body's bytes at most (``tlm serve --max-body``). JSON parsing holds the GIL, so it bounds how long a
#: request can keep /health waiting (docs/benchmarks.md); a 128k-token prompt fits.
MAX_BODY = 1 << 20
#: ``torch.Generator.manual_seed``'s range: a seed outside it is refused (400), never raised in the scheduler.
SEED_RANGE = (-(2**63), 2**64 - 1)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What every request is checked against: the served model's name, its context and vocabulary, the characters
    a text prompt may have (more cannot fit the context) and the body's bytes at most."""

    model_name: str
    context_length: int
    vocab: int
    max_chars: int
    max_body: int


class _Strict(BaseModel):
    # Unknown fields are errors (a misspelt max_tokens must not be ignored); no silent "0.5" -> 0.5.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: str


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    user: str | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    # Known to OpenAI, not done here: refused by name (400), never ignored.
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None


#: Fields a client may send that this server refuses by name, with why.
UNSUPPORTED = {name: "function calling is not supported" for name in ("tools", "functions", "tool_choice",
                                                                     "function_call")}  # fmt: skip


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


def _role(value: str) -> str:
    """A message's role, one of :data:`tlm_tokenizer.chat.CHAT_ROLES` (a template writes its markers around it)."""
    if value not in CHAT_ROLES:
        raise ValueError(f"must be one of {', '.join(CHAT_ROLES)}, got {value[:40]!r}")
    return value


class ChatMessage(_Strict):
    role: Annotated[str, AfterValidator(_role)]
    content: str
    name: str | None = None  # text: encoded as the content is, whatever the template makes of it


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|function-\w+|[\w-]+\[.*\])$")


#: pydantic's error types that only say "not this type": for a union field (``stop``, ``prompt``) each member that
#: the value is not gives one, and the error worth reporting is the one a member of the right type gave.
_MISMATCH = re.compile(r"^(\w+_type|\w+_parsing|int_from_float|is_instance_of)$")


def _validation_error(err: ValidationError) -> APIError:
    errors = err.errors()
    # A list of 10^5 stops is "at most 4 items", a prompt [-1] is ">= 0": not "should be a valid string". When every
    # member refused the type, the deepest says most (stop [5]: "stop.0", the list's item, not the list).
    ranked = sorted(errors, key=lambda e: (bool(_MISMATCH.match(e.get("type", ""))), -len(e.get("loc", ()))))
    first: dict[str, Any] = dict(ranked[0]) if ranked else {}
    where = [str(part) for part in first.get("loc", ()) if not _TYPE_TAG.match(str(part))]
    message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid')}"
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {'.'.join(where)!r}"
    return APIError(400, message, param=".".join(where) or None)


def _check_utf8(value: Any, where: str) -> None:
    """400 naming the field when a string (a key or a value, at any depth) is not encodable UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise APIError(400, f"{where}: the text is not valid UTF-8 (a lone surrogate at character {err.start})",
                           param=where) from None  # fmt: skip
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_utf8(key, where)
            _check_utf8(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list) and value and not isinstance(value[0], int):
        for i, item in enumerate(value):
            _check_utf8(item, f"{where}.{i}")


async def read_body(raw: Request, max_body: int) -> bytes:
    """The body, refused (413) past ``max_body`` bytes: by its Content-Length before reading, else as it comes."""
    declared = raw.headers.get("content-length")
    too_large = APIError(413, f"the request body is over {max_body} bytes (tlm serve --max-body)",
                         code="request_too_large")  # fmt: skip
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise too_large
    parts, size = [], 0
    async for part in raw.stream():
        size += len(part)
        if size > max_body:
            raise too_large
        parts.append(part)
    return b"".join(parts)


def too_long(context_length: int, where: str, what: str) -> APIError:
    return APIError(400, f"This model's maximum context length is {context_length} tokens. However, {where} "
                    f"has {what}. Please reduce the prompt.", param=where.split(" ")[0],
                    code="context_length_exceeded")  # fmt: skip


def _check_sizes(data: dict[str, Any], limits: Limits, capacity: int) -> None:
    """400 for a prompt or messages that cannot fit the context (or more prompts than ``capacity``), judged by
    their lengths before any copy or tokenizing."""
    context_length, max_chars = limits.context_length, limits.max_chars
    prompt = data.get("prompt")
    if isinstance(prompt, str) and len(prompt) > max_chars:
        raise too_long(
            context_length, "prompt", f"{len(prompt)} characters, more than {context_length} tokens can hold"
        )
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int) and len(prompt) > context_length:
            raise too_long(context_length, "prompt", f"{len(prompt)} tokens")
        if prompt and not isinstance(prompt[0], int) and len(prompt) > capacity:
            raise APIError(400, f"prompt: {len(prompt)} prompts is more than this server takes at once "
                           f"({capacity})", param="prompt")  # fmt: skip
        for i, item in enumerate(prompt):
            if isinstance(item, list) and len(item) > context_length:
                raise too_long(context_length, f"prompt.{i}", f"{len(item)} tokens")
            if isinstance(item, str) and len(item) > max_chars:
                raise too_long(context_length, f"prompt.{i}",
                               f"{len(item)} characters, more than {context_length} tokens can hold")  # fmt: skip
    messages = data.get("messages")
    if isinstance(messages, list):
        # Each message a template writes costs a token at least: more than the context are refused unrendered.
        if len(messages) > context_length:
            raise too_long(context_length, "messages",
                           f"{len(messages)} messages, more than {context_length} tokens can hold")  # fmt: skip
        chars = sum(
            len(m[key]) for m in messages if isinstance(m, dict) for key in ("content", "name")
            if isinstance(m.get(key), str)
        )  # fmt: skip
        if chars > max_chars:
            raise too_long(
                context_length, "messages", f"{chars} characters, more than {context_length} tokens can hold"
            )


def parse(body: bytes, model: type[_Sampling], limits: Limits, capacity: int) -> Any:
    """The request, or the APIError that refuses it; size bounds come before any copy or tokenizing."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as err:
        raise APIError(400, f"the body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"body: the request must be a JSON object, got {type(data).__name__}")
    _check_sizes(data, limits, capacity)
    try:
        _check_utf8(data, "")
        request = model.model_validate(data)
    except ValidationError as err:
        raise _validation_error(err) from None
    except RecursionError:
        raise APIError(400, "body: the JSON is nested too deeply") from None
    for name, why in UNSUPPORTED.items():
        if getattr(request, name) is not None:
            raise APIError(400, f"{name}: {why} by this server", param=name)
    if request.response_format is not None and request.response_format.type != "text":
        raise APIError(400, f"response_format: only {{'type': 'text'}} is supported, got "
                       f"{request.response_format.type!r}", param="response_format")  # fmt: skip
    if request.model is not None and request.model != limits.model_name:
        raise APIError(404, f"the model {request.model!r} does not exist; this server serves {limits.model_name!r}",
                       param="model", code="model_not_found")  # fmt: skip
    return request
