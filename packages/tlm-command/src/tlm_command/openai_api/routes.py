"""The FastAPI app of ``tlm serve`` (the request models and checks are in
:mod:`~tlm_command.openai_api.protocol`, the answers in
:mod:`~tlm_command.openai_api.responses`)."""

import asyncio
import re
import sys
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from tlm_command.openai_api.protocol import (
    MAX_BODY,
    RETRY_AFTER_S,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    _Sampling,
    parse,
    read_body,
)
from tlm_command.openai_api.responses import ChatFormat, Choice, CompletionFormat, answer, ids_text
from tlm_command.sampling import GREEDY_BELOW
from tlm_command.scheduler import Closed, Failed, Piece, QueueFull, Scheduler
from tlm_command.scheduler import Request as Job


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


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
    limits = Limits(model_name, context_length, vocab, context_length * longest, max_body)

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

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Any:
        body: CompletionRequest = await run_in_threadpool(
            parse, await read_body(raw, max_body), CompletionRequest, limits, scheduler.capacity
        )
        raw_prompts: list[Any] = list(body.prompt) if isinstance(body.prompt, list) else [body.prompt]
        if raw_prompts and isinstance(raw_prompts[0], int):
            raw_prompts = [raw_prompts]
        if not raw_prompts:
            raise APIError(400, "prompt: give a prompt (text or token ids), or a list of them", param="prompt")

        def prepare() -> tuple[list[Job], list[str]]:
            prompts = [tokenizer.encode(p, allowed_special="none") if isinstance(p, str) else p for p in raw_prompts]
            jobs = jobs_for(body, prompts, 16, default_stops, logprobs=body.logprobs, echo=body.echo)
            texts = [p if isinstance(p, str) else ids_text(tokenizer, p) for p in raw_prompts]
            return jobs, texts

        jobs, texts = await run_in_threadpool(prepare)
        choices = [Choice(i, job, texts[i // body.n]) for i, job in enumerate(jobs)]
        form = CompletionFormat(body, choices, tokenizer, model_name)
        return await answer(run(jobs, raw), choices, raw, body.stream, form)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Any:
        body: ChatCompletionRequest = await run_in_threadpool(
            parse, await read_body(raw, max_body), ChatCompletionRequest, limits, scheduler.capacity
        )
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
        choices = [Choice(i, job, "") for i, job in enumerate(jobs)]
        form = ChatFormat(body, choices, tokenizer, model_name)
        return await answer(run(jobs, raw), choices, raw, body.stream, form)

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
