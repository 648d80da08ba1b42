"""The response side of the wire format: both endpoints' envelopes (``text_completion``, ``chat.completion`` and
their ``*.chunk`` stream objects), the usage, the two forms of log-probabilities, server-sent events, and
:func:`answer`, which turns the scheduler's pieces into the whole answer or its stream."""

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from tlm_command.openai_api.protocol import APIError, ChatCompletionRequest, CompletionRequest
from tlm_model.scheduler import Piece, Scored
from tlm_model.scheduler import Request as Job


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token]) if token < tokenizer.vocab_size else ""


def ids_text(tokenizer: Any, ids: list[int]) -> str:
    """The text of token ids, the ids past the tokenizer's vocabulary (a padded model's) as no text."""
    return "".join(token_text(tokenizer, i) for i in ids) if any(i >= tokenizer.vocab_size for i in ids) else (
        tokenizer.decode(ids))  # fmt: skip


def legacy_logprobs(tokenizer: Any, scored: list[Scored], offset: int) -> tuple[dict[str, Any], int]:
    """OpenAI's completions ``logprobs`` object for ``scored`` whose text starts at ``offset``; and the offset after
    them. ``top_logprobs`` maps each alternative's text to its log-probability (the best kept where two tokens read
    the same); the first prompt token's is null."""
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    for item in scored:
        text = token_text(tokenizer, item.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if item.logprob is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for token, logprob in item.top:
            top.setdefault(token_text(tokenizer, token), logprob)
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


class Choice:
    """One choice in flight: its job, and what the answer has said of it so far."""

    def __init__(self, index: int, job: Job, prompt_text: str) -> None:
        self.index, self.job, self.prompt_text = index, job, prompt_text
        self.text: list[str] = []
        self.scored: list[Scored] = []
        self.prompt_scored: list[Scored] | None = None
        self.reason: str | None = None
        self.offset = 0  # characters of the choice's text sent so far (the stream's text_offset)


def usage(choices: list[Choice]) -> dict[str, int]:
    prompts = {id(c.job.prompt): len(c.job.prompt) for c in choices}  # each prompt once, whatever n is
    done = sum(c.job.completion_tokens for c in choices)
    return {"prompt_tokens": sum(prompts.values()), "completion_tokens": done,
            "total_tokens": sum(prompts.values()) + done}  # fmt: skip


def last_chunk(choices: list[Choice], with_usage: bool) -> Callable[[Piece], bool]:
    """Whether a stream's chunk for ``piece`` carries the usage: once per answer, on the last choice's last
    chunk, unless ``stream_options.include_usage`` asks for a chunk of its own at the end (OpenAI's)."""

    def here(piece: Piece) -> bool:
        return not with_usage and piece.finish_reason is not None and all(c.reason is not None for c in choices)

    return here


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def failure(piece: Piece) -> APIError:
    return APIError(500, piece.error or "the request failed", kind="server_error")


class Format(Protocol):
    """An endpoint's answer: the stream's chunks for each piece, the whole answer, and the stream's last chunk."""

    def chunks(self, choice: Choice, piece: Piece) -> list[dict[str, Any]]: ...

    def final(self) -> dict[str, Any]: ...

    def tail(self) -> dict[str, Any] | None: ...


class _Envelopes:
    """What both formats share: the answer's id and time, and the envelope each chunk goes in (``OBJECT``)."""

    PREFIX, OBJECT = "", ""

    def __init__(self, body: Any, choices: list[Choice], tokenizer: Any, model_name: str) -> None:
        self.body, self.choices, self.tokenizer, self.model_name = body, choices, tokenizer, model_name
        self.ident, self.now = f"{self.PREFIX}-{uuid.uuid4().hex}", int(time.time())
        self.with_usage = body.stream_options is not None and body.stream_options.include_usage
        self.usage_here = last_chunk(choices, self.with_usage)

    def envelope(self, items: list[dict[str, Any]], with_usage: bool) -> dict[str, Any]:
        return {"id": self.ident, "object": self.OBJECT, "created": self.now, "model": self.model_name,
                "choices": items, "usage": usage(self.choices) if with_usage else None}  # fmt: skip

    def tail(self) -> dict[str, Any] | None:
        return self.envelope([], with_usage=True) if self.with_usage else None


class CompletionFormat(_Envelopes):
    """``text_completion`` objects: echo puts the prompt first; ``logprobs`` is the legacy object."""

    PREFIX, OBJECT = "cmpl", "text_completion"
    body: CompletionRequest

    def chunks(self, choice: Choice, piece: Piece) -> list[dict[str, Any]]:
        text, scored = piece.text, list(piece.scored)
        if piece.prompt_scored is not None:  # echo: the prompt comes first
            text, scored = choice.prompt_text + text, [*piece.prompt_scored, *scored]
        choice.reason = piece.finish_reason
        logprobs = None
        if self.body.logprobs is not None:
            logprobs, choice.offset = legacy_logprobs(self.tokenizer, scored, choice.offset)
        else:
            choice.offset += len(text)
        if not text and logprobs is None and piece.finish_reason is None:
            return []
        item = {"index": choice.index, "text": text, "finish_reason": piece.finish_reason, "logprobs": logprobs}
        return [self.envelope([item], with_usage=self.usage_here(piece))]

    def final(self) -> dict[str, Any]:
        items = []
        for choice in self.choices:
            text = "".join(choice.text)
            scored = choice.scored
            if self.body.echo:
                text, scored = choice.prompt_text + text, [*(choice.prompt_scored or []), *scored]
            logprobs = legacy_logprobs(self.tokenizer, scored, 0)[0] if self.body.logprobs is not None else None
            items.append({"index": choice.index, "text": text, "finish_reason": choice.reason,
                          "logprobs": logprobs})  # fmt: skip
        return self.envelope(items, with_usage=True)


class ChatFormat(_Envelopes):
    """``chat.completion`` and its chunks: a stream opens each choice with the assistant's role."""

    PREFIX, OBJECT = "chatcmpl", "chat.completion.chunk"
    body: ChatCompletionRequest

    def __init__(self, body: ChatCompletionRequest, choices: list[Choice], tokenizer: Any, model_name: str) -> None:
        super().__init__(body, choices, tokenizer, model_name)
        self.started: set[int] = set()

    def chunks(self, choice: Choice, piece: Piece) -> list[dict[str, Any]]:
        out = []
        if choice.index not in self.started:
            self.started.add(choice.index)
            out.append(self.envelope([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None, "logprobs": None}], False))  # fmt: skip
        logprobs = {"content": chat_logprobs(self.tokenizer, piece.scored)} if self.body.logprobs else None
        if piece.text or (logprobs and piece.scored):
            out.append(self.envelope([{"index": choice.index, "delta": {"content": piece.text},
                                       "finish_reason": None, "logprobs": logprobs}], False))  # fmt: skip
        if piece.finish_reason is not None:
            choice.reason = piece.finish_reason
            out.append(self.envelope([{"index": choice.index, "delta": {}, "finish_reason": piece.finish_reason,
                                       "logprobs": None}], self.usage_here(piece)))  # fmt: skip
        return out

    def final(self) -> dict[str, Any]:
        logprobs = self.body.logprobs
        return {"id": self.ident, "object": "chat.completion", "created": self.now, "model": self.model_name,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": "".join(c.text)},
                             "finish_reason": c.reason,
                             "logprobs": {"content": chat_logprobs(self.tokenizer, c.scored)} if logprobs else None}
                            for c in self.choices],
                "usage": usage(self.choices)}  # fmt: skip


async def answer(events: AsyncGenerator[tuple[int, Piece], None], choices: list[Choice], raw: Request, stream: bool,
                 form: Format) -> Any:  # fmt: skip
    """Answer with ``events``: the whole ``form.final()`` answer, or a stream of ``form.chunks`` (then
    ``form.tail()``)."""
    first = await anext(events, None)  # errors before the first piece are still an HTTP status
    if first is not None and first[1].finish_reason == "error":
        await events.aclose()
        raise failure(first[1])
    if stream:
        return StreamingResponse(_stream(first, events, choices, raw, form), media_type="text/event-stream")
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
    return form.final()


async def _stream(first: tuple[int, Piece] | None, events: AsyncGenerator[tuple[int, Piece], None],
                  choices: list[Choice], raw: Request, form: Format) -> AsyncIterator[str]:  # fmt: skip
    """The server-sent events of an answer whose first event is ``first``: an error event ends it early."""
    try:
        event = first
        while event is not None:
            index, piece = event
            if piece.finish_reason == "error":
                yield sse(failure(piece).body())
                break
            for chunk in form.chunks(choices[index], piece):
                yield sse(chunk)
            event = await anext(events, None)
        else:
            if (end := form.tail()) is not None:
                yield sse(end)
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away mid-stream: its rows are freed at the next step
        await events.aclose()
        raw.state.usage = usage(choices)
