"""The FastAPI app of ``tlm serve``: :func:`create_app` wires the routes to the request models
(:mod:`~tlm_command.openai_api.protocol`), the jobs (:mod:`~tlm_command.openai_api.jobs`) and the answers
(:mod:`~tlm_command.openai_api.responses`); the error handlers, ``/health``, ``/v1/models`` and the access log
live here."""

import sys
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from tlm_command.openai_api.jobs import chat_jobs, chat_setup, completion_jobs, completion_prompts, run_jobs
from tlm_command.openai_api.protocol import (
    MAX_BODY,
    RETRY_AFTER_S,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    parse,
    read_body,
)
from tlm_command.openai_api.responses import ChatFormat, Choice, CompletionFormat, answer
from tlm_model.scheduler import Scheduler


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


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
    vocab = vocab_size if vocab_size is not None else tokenizer.vocab_size
    # A text prompt longer than this many characters cannot fit the context: no token is longer (in UTF-8
    # bytes, so in characters) than the longest in the vocabulary. Checked before tokenizing.
    longest = max(len(token) for token in tokenizer.vocab.values())
    limits = Limits(model_name, context_length, vocab, context_length * longest, max_body)

    if access_log:
        app.add_middleware(_AccessLog)
    _add_error_handlers(app)
    _add_status_routes(app, scheduler, model_name)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Any:
        body: CompletionRequest = await run_in_threadpool(
            parse, await read_body(raw, max_body), CompletionRequest, limits, scheduler.capacity
        )
        prompts = completion_prompts(body)
        jobs, texts = await run_in_threadpool(
            completion_jobs, body, prompts, tokenizer, default_stops, limits, scheduler.capacity
        )
        choices = [Choice(i, job, texts[i // body.n]) for i, job in enumerate(jobs)]
        form = CompletionFormat(body, choices, tokenizer, model_name)
        events = run_jobs(scheduler, jobs, raw, app.state.draining)
        return await answer(events, choices, raw, body.stream, form)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Any:
        body: ChatCompletionRequest = await run_in_threadpool(
            parse, await read_body(raw, max_body), ChatCompletionRequest, limits, scheduler.capacity
        )
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        render, stops, top = chat_setup(body, chat_template, default_stops)
        jobs = await run_in_threadpool(
            chat_jobs, body, messages, render, stops, top, tokenizer, limits, scheduler.capacity
        )
        choices = [Choice(i, job, "") for i, job in enumerate(jobs)]
        form = ChatFormat(body, choices, tokenizer, model_name)
        return await answer(run_jobs(scheduler, jobs, raw, app.state.draining), choices, raw, body.stream, form)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object: ours, Starlette's (404, 405) and any other (500)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(err.status_code, str(err.detail), code=None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        return _error_response(APIError(500, f"the server failed: {type(err).__name__}: {err}", kind="server_error"))


def _add_status_routes(app: FastAPI, scheduler: Scheduler, model_name: str) -> None:
    """``GET /health`` (503 while draining or after the model failed) and ``GET /v1/models``."""
    created = int(time.time())

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
