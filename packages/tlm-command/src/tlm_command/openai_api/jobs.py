"""From a validated request to the scheduler's jobs: prompts encoded (text never becomes a special token), the chat
template rendered, each job checked against the context and the vocabulary; and :func:`run_jobs`, which submits them
and yields the pieces the scheduler thread emits."""

import asyncio
import re
import threading
import weakref
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.requests import Request

from tlm_command.openai_api.protocol import (
    RETRY_AFTER_S,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    _Sampling,
)
from tlm_command.openai_api.responses import ids_text
from tlm_model.sampling import GREEDY_BELOW
from tlm_model.scheduler import Closed, Failed, Piece, QueueFull, Scheduler
from tlm_model.scheduler import Request as Job

#: The chat template of a base model (one without a template of its own): each message on its own line
#: as "Role: content", then "Assistant:" for the model to continue; "\nUser:" is a stop text, so a base
#: model does not write the user's next turn too.
PLAIN_CHAT_STOP = "\nUser:"
#: A chat template: the messages (dicts of role, content and maybe name) to the prompt's text.
Render = Callable[[list[dict[str, str]]], str]


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


def logit_bias(body: _Sampling, vocab: int) -> dict[int, float] | None:
    if not body.logit_bias:
        return None
    bias = {}
    for key, value in body.logit_bias.items():
        # ASCII digits only ("²" is a digit to str.isdigit, not to int), and few: int() of thousands is refused.
        if not (_TOKEN_ID.fullmatch(key) and int(key) < vocab):
            raise APIError(400, f"logit_bias: keys must be token ids below {vocab}, got {key!r}", param="logit_bias")
        bias[int(key)] = value
    return bias


def _max_tokens(where: str, prompt: list[int], explicit: int | None, default_max: int | None, limits: Limits) -> int:
    """The prompt's ``max_tokens``, the prompt checked first: not empty, ids in the vocabulary, fits the context."""
    vocab, context_length = limits.vocab, limits.context_length
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
    return max_tokens


def jobs_for(body: _Sampling, prompts: list[list[int]], default_max: int | None, stops: list[str], limits: Limits,
             capacity: int, *, logprobs: int | None = None, echo: bool = False) -> list[Job]:  # fmt: skip
    """One job per prompt and choice (``n``), in the answer's order, each checked against the context."""
    explicit = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if explicit == 0 and not echo:
        raise APIError(400, "max_tokens: 0 generates nothing, which only scores the prompt: it needs echo",
                       param="max_tokens")  # fmt: skip
    if len(prompts) * body.n > capacity:
        raise APIError(400, f"n: {len(prompts)} prompts x n={body.n} choices is more than this server takes at "
                       f"once ({capacity})", param="n")  # fmt: skip
    bias = logit_bias(body, limits.vocab)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    temperature = 0.0 if body.temperature < GREEDY_BELOW else body.temperature
    jobs = []
    for p, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt.{p}"
        max_tokens = _max_tokens(where, prompt, explicit, default_max, limits)
        for choice in range(body.n):
            seed = body.seed
            if seed is not None and choice:  # distinct choices, each reproducible; choice 0 is the seed itself
                seed = (seed + choice) % 2**64
            jobs.append(Job(prompt=prompt, max_tokens=max_tokens, emit=lambda piece: None, temperature=temperature,
                            top_p=None if body.top_p >= 1.0 else body.top_p, seed=seed, stop=[*stop, *stops],
                            logprobs=logprobs, echo=echo, presence_penalty=body.presence_penalty,
                            frequency_penalty=body.frequency_penalty, logit_bias=bias))  # fmt: skip
    return jobs


def completion_prompts(body: CompletionRequest) -> list[Any]:
    """The request's prompts as a list (one text or one id list is a list of one), refused (400) when empty."""
    raw_prompts: list[Any] = list(body.prompt) if isinstance(body.prompt, list) else [body.prompt]
    if raw_prompts and isinstance(raw_prompts[0], int):
        raw_prompts = [raw_prompts]
    if not raw_prompts:
        raise APIError(400, "prompt: give a prompt (text or token ids), or a list of them", param="prompt")
    return raw_prompts


def completion_jobs(body: CompletionRequest, raw_prompts: list[Any], tokenizer: Any, stops: list[str],
                    limits: Limits, capacity: int) -> tuple[list[Job], list[str]]:  # fmt: skip
    """The completion's jobs (up to 16 tokens each by default, OpenAI's) and each prompt's text (what echo sends)."""
    prompts = [tokenizer.encode(p, allowed_special="none") if isinstance(p, str) else p for p in raw_prompts]
    jobs = jobs_for(body, prompts, 16, stops, limits, capacity, logprobs=body.logprobs, echo=body.echo)
    texts = [p if isinstance(p, str) else ids_text(tokenizer, p) for p in raw_prompts]
    return jobs, texts


def chat_setup(body: ChatCompletionRequest, chat_template: Render | None,
               default_stops: list[str]) -> tuple[Render, list[str], int]:  # fmt: skip
    """The template to render with (the plain one for a base model, with its stop text), the stops, and the
    top-k of ``top_logprobs`` (which needs ``logprobs``: else 400)."""
    render, stops = (
        (chat_template, default_stops) if chat_template is not None
        else (plain_chat_prompt, [*default_stops, PLAIN_CHAT_STOP])
    )  # fmt: skip
    top = body.top_logprobs if body.top_logprobs is not None else 0
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    return render, stops, top


def chat_jobs(body: ChatCompletionRequest, messages: list[dict[str, str]], render: Render, stops: list[str], top: int,
              tokenizer: Any, limits: Limits, capacity: int) -> list[Job]:  # fmt: skip
    """The chat's jobs: the messages rendered and encoded (a template that fails on them is a 400)."""
    try:
        ids = chat_prompt_ids(render, messages, tokenizer)
    except TemplateError as err:
        raise APIError(400, f"messages: the chat template failed on them: {err}", param="messages") from None
    return jobs_for(body, [ids], None, stops, limits, capacity, logprobs=top if body.logprobs else None)


class _Mailbox:
    """Pieces from the scheduler thread to an event loop's queues, with one wake-up of the loop for all the
    pieces posted before it runs (a step of 16 streaming rows: one ``call_soon_threadsafe``, not 16), in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.lock = loop, threading.Lock()
        self.items: list[tuple[asyncio.Queue[tuple[int, Piece]], tuple[int, Piece]]] = []

    def post(self, queue: "asyncio.Queue[tuple[int, Piece]]", item: tuple[int, Piece]) -> None:
        with self.lock:
            self.items.append((queue, item))
            if len(self.items) > 1:  # a wake-up is already on its way
                return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except BaseException:  # a closed loop: nothing will deliver, and the next post tries again
            with self.lock:
                self.items.clear()
            raise

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, item in items:
            queue.put_nowait(item)


_MAILBOXES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox]" = weakref.WeakKeyDictionary()


async def run_jobs(
    scheduler: Scheduler, jobs: list[Job], raw: Request, draining: bool
) -> AsyncGenerator[tuple[int, Piece], None]:
    """Submit ``jobs``; yield (job index, piece) as the scheduler thread emits them, until each has ended."""
    if draining:
        raise APIError(503, "the server is shutting down", kind="server_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, Piece]] = asyncio.Queue()
    mailbox = _MAILBOXES.get(loop)
    if mailbox is None:
        mailbox = _MAILBOXES[loop] = _Mailbox(loop)

    def emitter(index: int) -> Callable[[Piece], None]:
        def emit(piece: Piece) -> None:
            mailbox.post(queue, (index, piece))

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
