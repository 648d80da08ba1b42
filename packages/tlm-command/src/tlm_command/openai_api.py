"""The HTTP side of ``tlm serve``: OpenAI's completions and chat completions API on FastAPI.

The wire format is OpenAI's, so its clients work unchanged: ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` as server-sent events of ``*.chunk`` objects, ending
with ``data: [DONE]``), ``GET /v1/models`` and ``GET /health``. Every error is OpenAI's error object
(``{"error": {"message", "type", "param", "code"}}``) with a 4xx status: 400 for malformed JSON, an
unknown or mistyped field or a value out of range, 404 for another model's name, 429 with
``Retry-After`` when the queue is full, 503 with ``Retry-After`` while the server shuts down.

A prompt whose tokens plus ``max_tokens`` exceed the model's context is refused with 400
(``context_length_exceeded``), as OpenAI does; the server never slides a window, so every answer is
exactly what the model gives that prompt. ``max_tokens`` defaults to 16 for completions (OpenAI's
default) and to the rest of the context for chat.
"""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from tlm_command.scheduler import Closed, QueueFull, Scheduler
from tlm_command.scheduler import Request as Job

#: How long a client is told to wait before retrying a full or closing server (the Retry-After header).
RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers


def _error_response(err: APIError) -> JSONResponse:
    body = {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}
    return JSONResponse(body, status_code=err.status, headers=err.headers)


class _Strict(BaseModel):
    # Unknown fields are errors (a misspelt max_tokens must not be ignored); no silent "0.5" -> 0.5.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None


#: The chat template of a base model (one without a template of its own): each message on its own line
#: as "Role: content", then "Assistant:" for the model to continue; "\nUser:" is a stop text, so a base
#: model does not write the user's next turn too.
PLAIN_CHAT_STOP = "\nUser:"


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """``System: ...\\nUser: ...\\nAssistant: ...\\n...Assistant:`` (see :data:`PLAIN_CHAT_STOP`)."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


def create_app(
    scheduler: Scheduler,
    tokenizer: Any,
    *,
    model_name: str,
    context_length: int,
    chat_template: Any = None,
    default_stops: list[str],
) -> FastAPI:
    """The FastAPI app; ``chat_template`` is a callable ``messages -> prompt text`` (None: the plain one)."""
    app = FastAPI(title="tlm serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            where = []
        else:
            message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid')}"
            if first.get("type") == "extra_forbidden":
                message = f"unknown field {'.'.join(where)!r}"
        return _error_response(APIError(400, message, param=".".join(where) or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(err.status_code, str(err.detail), code=None))

    @app.get("/health")
    async def health() -> JSONResponse:
        if app.state.draining or scheduler.error is not None:
            return JSONResponse({"status": "unavailable"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        counts = {"active": scheduler.active, "waiting": scheduler.waiting, "steps": scheduler.steps}
        return JSONResponse({"status": "ok", **counts})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "tlm"}],
        }

    async def prepare(body: _Sampling, prompt: list[int], default_max: int | None, stops: list[str]) -> Job:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        if not prompt:
            raise APIError(400, "the prompt is empty: give at least one token", param="prompt")
        if any(i >= tokenizer.vocab_size for i in prompt):
            raise APIError(400, f"prompt token ids must be below the vocabulary size {tokenizer.vocab_size}",
                           param="prompt")  # fmt: skip
        explicit = getattr(body, "max_completion_tokens", None) or body.max_tokens
        max_tokens = explicit if explicit is not None else (default_max or context_length - len(prompt))
        if len(prompt) + max(max_tokens, 1) > context_length:
            raise APIError(
                400,
                f"This model's maximum context length is {context_length} tokens. However, you requested "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} for the completion). "
                "Please reduce the prompt or the completion length.",
                param="max_tokens" if explicit is not None else "prompt",
                code="context_length_exceeded",
            )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return Job(prompt=prompt, max_tokens=max_tokens, emit=lambda text, reason: None,
                   temperature=body.temperature, top_p=None if body.top_p >= 1.0 else body.top_p, seed=body.seed,
                   stop=[*stop, *stops])  # fmt: skip

    async def run(job: Job, raw: Request) -> AsyncGenerator[tuple[str, str | None], None]:
        """Submit ``job``; yield (text, finish_reason) as the scheduler thread emits them."""
        if app.state.draining:
            raise APIError(503, "the server is shutting down", kind="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, str | None]] = asyncio.Queue()

        def emit(text: str, reason: str | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (text, reason))

        job.emit = emit
        try:
            scheduler.submit(job)
        except QueueFull as err:
            raise APIError(429, f"the server is busy: {err}; retry later", kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None  # fmt: skip
        except Closed:
            raise APIError(503, "the server is shutting down", kind="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None  # fmt: skip
        try:
            while True:
                try:
                    text, reason = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await raw.is_disconnected():
                        return
                    continue
                yield text, reason
                if reason is not None:
                    return
        finally:
            job.cancelled.set()  # a client that went away frees its row at the next step

    def usage(job: Job) -> dict[str, int]:
        done = job.completion_tokens
        return {"prompt_tokens": len(job.prompt), "completion_tokens": done, "total_tokens": len(job.prompt) + done}

    def sse(data: Any) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def encode(text: str) -> list[int]:
        return await run_in_threadpool(tokenizer.encode, text)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        prompt = await encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        job = await prepare(body, prompt, 16, default_stops)
        ident, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, reason: str | None, with_usage: bool) -> dict[str, Any]:
            return {"id": ident, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}],
                    "usage": usage(job) if with_usage else None}  # fmt: skip

        if body.stream:
            events = run(job, raw)
            first = await anext(events)  # errors before the first token are still an HTTP status

            async def stream() -> AsyncIterator[str]:
                try:
                    event: tuple[str, str | None] | None = first
                    while event is not None:
                        yield sse(chunk(event[0], event[1], event[1] is not None))
                        event = await anext(events, None)
                    if body.stream_options is not None and body.stream_options.include_usage:
                        yield sse({**chunk("", None, True), "choices": []})
                    yield "data: [DONE]\n\n"
                finally:  # also when the client went away mid-stream: its row is freed at the next step
                    await events.aclose()

            return StreamingResponse(stream(), media_type="text/event-stream")
        parts, reason = [], None
        async for text, reason in run(job, raw):  # noqa: B007 - the last reason is the answer's
            parts.append(text)
        return {**chunk("".join(parts), reason, True)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Any:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        if chat_template is not None:
            text, stops = chat_template(messages), default_stops
        else:
            text, stops = plain_chat_prompt(messages), [*default_stops, PLAIN_CHAT_STOP]
        job = await prepare(body, await encode(text), None, stops)
        ident, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict[str, str], reason: str | None, with_usage: bool) -> dict[str, Any]:
            return {"id": ident, "object": "chat.completion.chunk", "created": now, "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}],
                    "usage": usage(job) if with_usage else None}  # fmt: skip

        if body.stream:
            events = run(job, raw)
            first = await anext(events)

            async def stream() -> AsyncIterator[str]:
                try:
                    yield sse(chunk({"role": "assistant", "content": ""}, None, False))
                    event: tuple[str, str | None] | None = first
                    while event is not None:
                        text, reason = event
                        if text:
                            yield sse(chunk({"content": text}, None, False))
                        if reason is not None:
                            yield sse(chunk({}, reason, True))
                        event = await anext(events, None)
                    if body.stream_options is not None and body.stream_options.include_usage:
                        yield sse({**chunk({}, None, True), "choices": []})
                    yield "data: [DONE]\n\n"
                finally:
                    await events.aclose()

            return StreamingResponse(stream(), media_type="text/event-stream")
        parts, reason = [], None
        async for text, reason in run(job, raw):  # noqa: B007 - the last reason is the answer's
            parts.append(text)
        return {"id": ident, "object": "chat.completion", "created": now, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                             "finish_reason": reason, "logprobs": None}],
                "usage": usage(job)}  # fmt: skip

    return app
