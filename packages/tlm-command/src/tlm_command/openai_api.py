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
below :data:`~tlm_command.sampling.GREEDY_BELOW` (greedy). Parsing, tokenizing and the chat template run in
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

import asyncio
import json
import re
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from tlm_command.sampling import GREEDY_BELOW
from tlm_command.scheduler import Closed, Failed, Piece, QueueFull, Scheduler, Scored
from tlm_command.scheduler import Request as Job
from tlm_tokenizer.chat import CHAT_ROLES

#: How long a client is told to wait before retrying a full or closing server (the Retry-After header).
RETRY_AFTER_S = 1
#: The request body's bytes at most (``tlm serve --max-body``). JSON parsing holds the GIL, so it bounds how long a
#: request can keep /health waiting: 1 MiB of token ids (~400k) parses in about 40 ms; a 128k-token prompt fits.
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


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


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


#: The chat template of a base model (one without a template of its own): each message on its own line
#: as "Role: content", then "Assistant:" for the model to continue; "\nUser:" is a stop text, so a base
#: model does not write the user's next turn too.
PLAIN_CHAT_STOP = "\nUser:"


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """``System: ...\\nUser: ...\\nAssistant: ...\\n...Assistant:`` (see :data:`PLAIN_CHAT_STOP`)."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


class TemplateError(Exception):
    """A chat template failed on a request's messages (a 400: the messages are what it refused)."""


def chat_prompt_ids(render: Callable[[list[dict[str, str]]], str], messages: list[dict[str, str]],
                    tokenizer: Any) -> list[int]:  # fmt: skip
    """The ids of ``render(messages)`` in which only the template's own text may hold special tokens.

    Where the contents (and names) lie comes from a second render with a random mark for each
    (:func:`tlm_tokenizer.chat.locate_contents`); special tokens are then matched in the template's text only and
    the rest is encoded as text (:func:`tlm_tokenizer.chat.encode_pieces`, what training encodes with), so the ids
    are ``tokenizer.encode(text)``'s except that no content becomes a special token. A template that changes
    contents (trims them, say) gets its whole text encoded with no special token at all.
    """
    from tlm_tokenizer.chat import encode_pieces, locate_contents, render_time_limit

    try:
        with render_time_limit("messages"):  # a template that loops is stopped, and this worker thread freed
            text, fields = locate_contents(render, messages)
    except Exception as err:
        raise TemplateError(f"{type(err).__name__}: {err}") from err
    if fields is None:
        return tokenizer.encode(text, allowed_special="none")
    return [token for _, ids in encode_pieces(tokenizer, text, [(a, b) for _, _, a, b in fields]) for token in ids]


_TOKEN_ID = re.compile(r"[0-9]{1,19}")
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|function-\w+|[\w-]+\[.*\])$")


def _validation_error(err: ValidationError) -> APIError:
    first: dict[str, Any] = dict(err.errors()[0]) if err.errors() else {}
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


def _token(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token]) if token < tokenizer.vocab_size else ""


def legacy_logprobs(tokenizer: Any, scored: list[Scored], offset: int) -> tuple[dict[str, Any], int]:
    """OpenAI's completions ``logprobs`` object for ``scored`` whose text starts at ``offset``; and the offset after
    them. ``top_logprobs`` maps each alternative's text to its log-probability (the best kept where two tokens read
    the same); the first prompt token's is null."""
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    for item in scored:
        text = _token(tokenizer, item.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if item.logprob is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for token, logprob in item.top:
            top.setdefault(_token(tokenizer, token), logprob)
        tops.append(top)
    body = {"tokens": tokens, "token_logprobs": [item.logprob for item in scored], "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip
    return body, offset


def chat_logprobs(tokenizer: Any, scored: list[Scored]) -> list[dict[str, Any]]:
    """OpenAI's chat ``logprobs.content`` entries for ``scored``."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        raw = tokenizer.decode_bytes([token]) if token < tokenizer.vocab_size else b""
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return [
        {**entry(item.token, item.logprob or 0.0), "top_logprobs": [entry(t, lp) for t, lp in item.top]}
        for item in scored
    ]


class _Choice:
    """One choice in flight: its job, and what the answer has said of it so far."""

    def __init__(self, index: int, job: Job, prompt_text: str) -> None:
        self.index, self.job, self.prompt_text = index, job, prompt_text
        self.text: list[str] = []
        self.scored: list[Scored] = []
        self.prompt_scored: list[Scored] | None = None
        self.reason: str | None = None
        self.offset = 0  # characters of the choice's text sent so far (the stream's text_offset)


def create_app(
    scheduler: Scheduler,
    tokenizer: Any,
    *,
    model_name: str,
    context_length: int,
    chat_template: Callable[[list[dict[str, str]]], str] | None = None,
    default_stops: list[str],
    vocab_size: int | None = None,
    max_body: int = MAX_BODY,
    access_log: bool = False,
) -> FastAPI:
    """The FastAPI app; ``chat_template`` is a callable ``messages -> prompt text`` (None: the plain one)."""
    app = FastAPI(title="tlm serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    created = int(time.time())
    vocab = vocab_size if vocab_size is not None else tokenizer.vocab_size
    # A text prompt longer than this many characters cannot fit the context: no token is longer (in UTF-8
    # bytes, so in characters) than the longest in the vocabulary. Checked before tokenizing.
    longest = max(len(token) for token in tokenizer.vocab.values())
    max_chars = context_length * longest

    if access_log:
        app.add_middleware(_AccessLog)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(err.status_code, str(err.detail), code=None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        return _error_response(APIError(500, f"the server failed: {type(err).__name__}: {err}", kind="server_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if app.state.draining or scheduler.error is not None:
            return JSONResponse({"status": "unavailable"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        counts = {"active": scheduler.active, "waiting": scheduler.waiting, "steps": scheduler.steps,
                  **scheduler.engine_status()}  # fmt: skip
        return JSONResponse({"status": "ok", **counts})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "tlm"}],
        }

    async def read_body(raw: Request) -> bytes:
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

    def too_long(where: str, what: str) -> APIError:
        return APIError(400, f"This model's maximum context length is {context_length} tokens. However, {where} "
                        f"has {what}. Please reduce the prompt.", param=where.split(" ")[0],
                        code="context_length_exceeded")  # fmt: skip

    def parse(body: bytes, model: type[_Sampling]) -> Any:
        """The request, or the APIError that refuses it; size bounds come before any copy or tokenizing."""
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as err:
            raise APIError(400, f"the body is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise APIError(400, f"body: the request must be a JSON object, got {type(data).__name__}")
        prompt = data.get("prompt")
        if isinstance(prompt, str) and len(prompt) > max_chars:
            raise too_long("prompt", f"{len(prompt)} characters, more than {context_length} tokens can hold")
        if isinstance(prompt, list):
            if prompt and isinstance(prompt[0], int) and len(prompt) > context_length:
                raise too_long("prompt", f"{len(prompt)} tokens")
            if prompt and not isinstance(prompt[0], int) and len(prompt) > scheduler.capacity:
                raise APIError(400, f"prompt: {len(prompt)} prompts is more than this server takes at once "
                               f"({scheduler.capacity})", param="prompt")  # fmt: skip
            for i, item in enumerate(prompt):
                if isinstance(item, list) and len(item) > context_length:
                    raise too_long(f"prompt.{i}", f"{len(item)} tokens")
                if isinstance(item, str) and len(item) > max_chars:
                    raise too_long(f"prompt.{i}", f"{len(item)} characters, more than {context_length} tokens can hold")
        messages = data.get("messages")
        if isinstance(messages, list):
            # Each message a template writes costs a token at least: more than the context are refused unrendered.
            if len(messages) > context_length:
                raise too_long("messages", f"{len(messages)} messages, more than {context_length} tokens can hold")
            chars = sum(
                len(m[key]) for m in messages if isinstance(m, dict) for key in ("content", "name")
                if isinstance(m.get(key), str)
            )  # fmt: skip
            if chars > max_chars:
                raise too_long("messages", f"{chars} characters, more than {context_length} tokens can hold")
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
        if request.model is not None and request.model != model_name:
            raise APIError(404, f"the model {request.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return request

    def logit_bias(body: _Sampling) -> dict[int, float] | None:
        if not body.logit_bias:
            return None
        bias = {}
        for key, value in body.logit_bias.items():
            # ASCII digits only ("²" is a digit to str.isdigit, not to int), and few: int() of thousands is refused.
            if not (_TOKEN_ID.fullmatch(key) and int(key) < vocab):
                raise APIError(
                    400, f"logit_bias: keys must be token ids below {vocab}, got {key!r}", param="logit_bias"
                )
            bias[int(key)] = value
        return bias

    def jobs_for(body: _Sampling, prompts: list[list[int]], default_max: int | None, stops: list[str], *,
                 logprobs: int | None = None, echo: bool = False) -> list[Job]:  # fmt: skip
        """One job per prompt and choice (``n``), in the answer's order, each checked against the context."""
        explicit = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if explicit == 0 and not echo:
            raise APIError(400, "max_tokens: 0 generates nothing, which only scores the prompt: it needs echo",
                           param="max_tokens")  # fmt: skip
        if len(prompts) * body.n > scheduler.capacity:
            raise APIError(400, f"n: {len(prompts)} prompts x n={body.n} choices is more than this server takes at "
                           f"once ({scheduler.capacity})", param="n")  # fmt: skip
        bias = logit_bias(body)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        temperature = 0.0 if body.temperature < GREEDY_BELOW else body.temperature
        jobs = []
        for p, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt.{p}"
            if not prompt:
                raise APIError(400, f"{where}: the prompt is empty: give at least one token", param="prompt")
            if any(i >= vocab for i in prompt):
                raise APIError(400, f"{where}: prompt token ids must be below the vocabulary size {vocab}",
                               param="prompt")  # fmt: skip
            max_tokens = explicit if explicit is not None else (default_max or context_length - len(prompt))
            if len(prompt) + max_tokens > context_length:
                raise APIError(
                    400,
                    f"This model's maximum context length is {context_length} tokens. However, you requested "
                    f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} for the "
                    "completion). Please reduce the prompt or the completion length.",
                    param="max_tokens" if explicit is not None else "prompt",
                    code="context_length_exceeded",
                )
            for choice in range(body.n):
                seed = body.seed
                if seed is not None and choice:  # distinct choices, each reproducible; choice 0 is the seed itself
                    seed = (seed + choice) % 2**64
                jobs.append(Job(prompt=prompt, max_tokens=max_tokens, emit=lambda piece: None, temperature=temperature,
                                top_p=None if body.top_p >= 1.0 else body.top_p, seed=seed, stop=[*stop, *stops],
                                logprobs=logprobs, echo=echo, presence_penalty=body.presence_penalty,
                                frequency_penalty=body.frequency_penalty, logit_bias=bias))  # fmt: skip
        return jobs

    async def run(jobs: list[Job], raw: Request) -> AsyncGenerator[tuple[int, Piece], None]:
        """Submit ``jobs``; yield (job index, piece) as the scheduler thread emits them, until each has ended."""
        if app.state.draining:
            raise APIError(503, "the server is shutting down", kind="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Piece]] = asyncio.Queue()

        def emitter(index: int) -> Callable[[Piece], None]:
            def emit(piece: Piece) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, (index, piece))

            return emit

        for index, job in enumerate(jobs):
            job.emit = emitter(index)
        try:
            scheduler.submit_all(jobs)
        except QueueFull as err:
            raise APIError(429, f"the server is busy: {err}; retry later", kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None  # fmt: skip
        except (Closed, Failed) as err:
            raise APIError(503, f"the server cannot take requests: {err}", kind="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None  # fmt: skip
        raw.state.jobs = jobs
        open_jobs = len(jobs)
        try:
            while open_jobs:
                try:
                    index, piece = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await raw.is_disconnected():
                        return
                    continue
                yield index, piece
                if piece.finish_reason is not None:
                    open_jobs -= 1
        finally:
            for job in jobs:
                job.cancelled.set()  # a client that went away frees its rows at the next step

    def usage(choices: list[_Choice]) -> dict[str, int]:
        prompts = {id(c.job.prompt): len(c.job.prompt) for c in choices}  # each prompt once, whatever n is
        done = sum(c.job.completion_tokens for c in choices)
        return {"prompt_tokens": sum(prompts.values()), "completion_tokens": done,
                "total_tokens": sum(prompts.values()) + done}  # fmt: skip

    def last_chunk(choices: list[_Choice], with_usage: bool) -> Callable[[Piece], bool]:
        """Whether a stream's chunk for ``piece`` carries the usage: once per answer, on the last choice's last
        chunk, unless ``stream_options.include_usage`` asks for a chunk of its own at the end (OpenAI's)."""

        def here(piece: Piece) -> bool:
            return not with_usage and piece.finish_reason is not None and all(c.reason is not None for c in choices)

        return here

    def sse(data: Any) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def failure(piece: Piece) -> APIError:
        return APIError(500, piece.error or "the request failed", kind="server_error")

    async def answer(jobs: list[Job], choices: list[_Choice], raw: Request, stream: bool,
                     chunks: Callable[[_Choice, Piece], list[dict[str, Any]]], final: Callable[[], dict[str, Any]],
                     tail: Callable[[], dict[str, Any] | None]) -> Any:  # fmt: skip
        """Run ``jobs`` and answer: the whole ``final()`` answer, or a stream of ``chunks`` (then ``tail()``)."""
        events = run(jobs, raw)
        first = await anext(events, None)  # errors before the first piece are still an HTTP status
        if first is not None and first[1].finish_reason == "error":
            await events.aclose()
            raise failure(first[1])
        if stream:

            async def body() -> AsyncIterator[str]:
                try:
                    event = first
                    while event is not None:
                        index, piece = event
                        if piece.finish_reason == "error":
                            yield sse(failure(piece).body())
                            break
                        for chunk in chunks(choices[index], piece):
                            yield sse(chunk)
                        event = await anext(events, None)
                    else:
                        if (end := tail()) is not None:
                            yield sse(end)
                    yield "data: [DONE]\n\n"
                finally:  # also when the client went away mid-stream: its rows are freed at the next step
                    await events.aclose()
                    raw.state.usage = usage(choices)

            return StreamingResponse(body(), media_type="text/event-stream")
        event = first
        while event is not None:
            index, piece = event
            if piece.finish_reason == "error":
                await events.aclose()
                raise failure(piece)
            choice = choices[index]
            choice.text.append(piece.text)
            choice.scored += piece.scored
            if piece.prompt_scored is not None:
                choice.prompt_scored = piece.prompt_scored
            choice.reason = piece.finish_reason or choice.reason
            event = await anext(events, None)
        raw.state.usage = usage(choices)
        return final()

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Any:
        body: CompletionRequest = await run_in_threadpool(parse, await read_body(raw), CompletionRequest)
        raw_prompts: list[Any] = list(body.prompt) if isinstance(body.prompt, list) else [body.prompt]
        if raw_prompts and isinstance(raw_prompts[0], int):
            raw_prompts = [raw_prompts]
        if not raw_prompts:
            raise APIError(400, "prompt: give a prompt (text or token ids), or a list of them", param="prompt")

        def prepare() -> tuple[list[Job], list[str]]:
            prompts = [tokenizer.encode(p, allowed_special="none") if isinstance(p, str) else p for p in raw_prompts]
            jobs = jobs_for(body, prompts, 16, default_stops, logprobs=body.logprobs, echo=body.echo)
            texts = [p if isinstance(p, str) else _decode(p) for p in raw_prompts]
            return jobs, texts

        jobs, texts = await run_in_threadpool(prepare)
        choices = [_Choice(i, job, texts[i // body.n]) for i, job in enumerate(jobs)]
        ident, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        usage_here = last_chunk(choices, with_usage)

        def envelope(items: list[dict[str, Any]], with_usage: bool) -> dict[str, Any]:
            return {"id": ident, "object": "text_completion", "created": now, "model": model_name, "choices": items,
                    "usage": usage(choices) if with_usage else None}  # fmt: skip

        def chunks(choice: _Choice, piece: Piece) -> list[dict[str, Any]]:
            text, scored = piece.text, list(piece.scored)
            if piece.prompt_scored is not None:  # echo: the prompt comes first
                text, scored = choice.prompt_text + text, [*piece.prompt_scored, *scored]
            choice.reason = piece.finish_reason
            logprobs = None
            if body.logprobs is not None:
                logprobs, choice.offset = legacy_logprobs(tokenizer, scored, choice.offset)
            else:
                choice.offset += len(text)
            if not text and logprobs is None and piece.finish_reason is None:
                return []
            item = {"index": choice.index, "text": text, "finish_reason": piece.finish_reason, "logprobs": logprobs}
            return [envelope([item], with_usage=usage_here(piece))]

        def final() -> dict[str, Any]:
            items = []
            for choice in choices:
                text = "".join(choice.text)
                scored = choice.scored
                if body.echo:
                    text, scored = choice.prompt_text + text, [*(choice.prompt_scored or []), *scored]
                logprobs = legacy_logprobs(tokenizer, scored, 0)[0] if body.logprobs is not None else None
                items.append({"index": choice.index, "text": text, "finish_reason": choice.reason,
                              "logprobs": logprobs})  # fmt: skip
            return envelope(items, with_usage=True)

        def tail() -> dict[str, Any] | None:
            return envelope([], with_usage=True) if with_usage else None

        return await answer(jobs, choices, raw, body.stream, chunks, final, tail)

    def _decode(ids: list[int]) -> str:
        return "".join(_token(tokenizer, i) for i in ids) if any(i >= tokenizer.vocab_size for i in ids) else (
            tokenizer.decode(ids))  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Any:
        body: ChatCompletionRequest = await run_in_threadpool(parse, await read_body(raw), ChatCompletionRequest)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        render, stops = (
            (chat_template, default_stops) if chat_template is not None
            else (plain_chat_prompt, [*default_stops, PLAIN_CHAT_STOP])
        )  # fmt: skip
        top = body.top_logprobs if body.top_logprobs is not None else 0
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")

        def prepare() -> list[Job]:
            try:
                ids = chat_prompt_ids(render, messages, tokenizer)
            except TemplateError as err:
                raise APIError(400, f"messages: the chat template failed on them: {err}", param="messages") from None
            return jobs_for(body, [ids], None, stops, logprobs=top if body.logprobs else None)

        jobs = await run_in_threadpool(prepare)
        choices = [_Choice(i, job, "") for i, job in enumerate(jobs)]
        ident, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        usage_here = last_chunk(choices, with_usage)
        started: set[int] = set()

        def envelope(items: list[dict[str, Any]], with_usage: bool) -> dict[str, Any]:
            return {"id": ident, "object": "chat.completion.chunk", "created": now, "model": model_name,
                    "choices": items, "usage": usage(choices) if with_usage else None}  # fmt: skip

        def chunks(choice: _Choice, piece: Piece) -> list[dict[str, Any]]:
            out = []
            if choice.index not in started:
                started.add(choice.index)
                out.append(envelope([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None, "logprobs": None}], False))  # fmt: skip
            logprobs = {"content": chat_logprobs(tokenizer, piece.scored)} if body.logprobs else None
            if piece.text or (logprobs and piece.scored):
                out.append(envelope([{"index": choice.index, "delta": {"content": piece.text}, "finish_reason": None,
                                      "logprobs": logprobs}], False))  # fmt: skip
            if piece.finish_reason is not None:
                choice.reason = piece.finish_reason
                out.append(envelope([{"index": choice.index, "delta": {}, "finish_reason": piece.finish_reason,
                                      "logprobs": None}], usage_here(piece)))  # fmt: skip
            return out

        def final() -> dict[str, Any]:
            return {"id": ident, "object": "chat.completion", "created": now, "model": model_name,
                    "choices": [{"index": c.index, "message": {"role": "assistant", "content": "".join(c.text)},
                                 "finish_reason": c.reason,
                                 "logprobs": {"content": chat_logprobs(tokenizer, c.scored)} if body.logprobs else None}
                                for c in choices],
                    "usage": usage(choices)}  # fmt: skip

        def tail() -> dict[str, Any] | None:
            return envelope([], with_usage=True) if with_usage else None

        return await answer(jobs, choices, raw, body.stream, chunks, final, tail)

    return app


class _AccessLog:
    """One stderr line per request: method, path, status, prompt and completion tokens, time to first token, total
    time (written when the response's last byte is sent, so a stream's line comes at its end)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]
        logged = [False]
        state = scope.setdefault("state", {})

        def log() -> None:
            if logged[0]:
                return
            logged[0] = True
            use = state.get("usage") or {}
            firsts = [j.first_token_at for j in state.get("jobs", ()) if j.first_token_at is not None]
            ttft = f"{min(firsts) - start:.3f}s" if firsts else "-"
            tokens = (
                f"prompt_tokens={use.get('prompt_tokens', '-')} completion_tokens={use.get('completion_tokens', '-')}"
            )
            print(f"tlm serve: {scope['method']} {scope['path']} {status[0]} {tokens} ttft={ttft} "
                  f"time={time.perf_counter() - start:.3f}s", file=sys.stderr, flush=True)  # fmt: skip

        async def logged_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log()

        try:
            await self.app(scope, receive, logged_send)
        finally:
            log()
