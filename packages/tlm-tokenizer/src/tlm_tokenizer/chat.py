"""Chat conversations to token ids, with the mask of the assistant's tokens, through a Jinja chat template.

The template is rendered as transformers renders one (``apply_chat_template``: a sandboxed Jinja environment
with ``trim_blocks`` and ``lstrip_blocks``, ``messages`` and ``add_generation_prompt``), so the ids equal
transformers' for the same tokenizer folder, whose ``tokenizer_config.json`` carries the template. One
difference is deliberate: a message's content is data, never control tokens. transformers tokenizes the
rendered text whole, so a user who types ``<|im_start|>`` gets the control token; here the special tokens are
matched only in the template's own text, and the contents are encoded as the ordinary text they are
(tiktoken's ``allowed_special``, HF's ``split_special_tokens``).

The assistant's tokens are found by rendering prefixes: the text of assistant message ``i`` runs from the
end of ``render(messages[:i], add_generation_prompt=True)`` to the end of ``render(messages[:i + 1])``
(its content, the end marker and what the template writes after it). A template for which these are not
prefixes of the whole conversation is refused. Rendering every prefix is quadratic in the messages, so it is
done once per template, on a probe conversation of two assistant turns: when both show the same text around
their content (``head``: after the generation prompt, ``tail``: to the turn's end), a conversation's turns are
found from where its contents lie, in two renders; a conversation whose text does not hold those edges around
each assistant content, or a template whose probe turns differ, takes the prefix renders.

Needs jinja2 (``pip install 'tlm-tokenizer[chat]'``), imported when a template is first compiled.
"""

import bisect
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: The ChatML markers of the default template: each is one special token.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_MARKERS = (IM_START, IM_END)
#: The default template: ChatML (OpenAI's, as Qwen and SmolLM write it), with no default system message.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: The roles a message may have: OpenAI's (``developer`` is its newer name for ``system``) and a tool's answer.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
#: The fields of a message that a user writes: data, encoded as text wherever the template puts them.
TEXT_FIELDS = ("content", "name")
#: Which tokens a conversation trains on: the assistant's, everything else, or all.
TRAIN_ON = ("completion", "prompt", "all")


#: How long rendering one conversation may take (every render :meth:`ChatTemplate.encode` or a server makes for
#: it): a template that loops is stopped there, freeing its thread.
RENDER_SECONDS = 2.0
#: The most characters a template's ``*`` (a string or list repeated) or ``**`` may make in one operation: a
#: single such C call cannot be interrupted by the time bound.
MAX_PRODUCT = 1 << 20


def render_time_limit(where: str) -> Any:
    """``with render_time_limit(where):`` bounds the renders inside to :data:`RENDER_SECONDS`; past it, they stop
    with a ValueError naming ``where``."""
    from tlm_core.limits import time_limit

    message = f"{where}: the chat template took more than {RENDER_SECONDS:g} s to render"
    return time_limit(RENDER_SECONDS, message, ValueError)


def _sandbox() -> Any:
    """transformers' environment for chat templates (sandboxed, immutable, ``trim_blocks``, ``lstrip_blocks``) whose
    ``*`` and ``**`` refuse a result over :data:`MAX_PRODUCT` (characters, items or bits)."""
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for seq, count in ((left, right), (right, left)):
                    if (
                        isinstance(seq, (str, list, tuple))
                        and isinstance(count, int)
                        and len(seq) * count > MAX_PRODUCT
                    ):
                        raise SecurityError(f"a repetition of {len(seq) * count:,} items is over {MAX_PRODUCT:,}")
            elif isinstance(left, int) and isinstance(right, int) and right > 0:
                if abs(left) > 1 and right * max(abs(left).bit_length(), 1) > MAX_PRODUCT:
                    raise SecurityError(
                        f"a power of about {right * abs(left).bit_length():,} bits is over {MAX_PRODUCT:,}"
                    )
            return super().call_binop(context, operator, left, right)

    return Bounded(trim_blocks=True, lstrip_blocks=True)


def compile_template(source: str) -> Callable[..., str]:
    """``source`` (Jinja) compiled as transformers compiles a chat template; ``render(messages=...,
    add_generation_prompt=...)``. Raises ValueError for a template that does not compile, and ``render`` raises
    ValueError for one that fails, recurses without end or makes a product over :data:`MAX_PRODUCT` (bound its
    time with :func:`render_time_limit`)."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"chat template must be a non-empty Jinja string, got {source!r:.60}")
    try:
        from jinja2 import TemplateError
    except ImportError:
        raise ValueError("a chat template needs jinja2: pip install 'tlm-tokenizer[chat]'") from None

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template refused the conversation: {message}")

    environment = _sandbox()
    environment.globals["raise_exception"] = raise_exception
    try:
        template = environment.from_string(source)
    except TemplateError as err:
        raise ValueError(f"chat template is not valid Jinja: {err}") from None

    def render(**context: Any) -> str:
        try:
            return str(template.render(**context))
        except TemplateError as err:
            raise ValueError(f"chat template failed to render: {err}") from None
        except RecursionError:
            raise ValueError("chat template failed to render: it recursed too deeply") from None

    return render


def check_messages(messages: object, where: str = "messages") -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content"}`` (and an optional ``"name"``) in OpenAI's chat format, or
    ValueError naming ``where`` and what is wrong. ``role`` must be one of :data:`CHAT_ROLES`: a template writes
    its markers around the role, so a free-text role would put text among the control tokens."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} must be a non-empty list of {{'role', 'content'}} objects, got {messages!r:.80}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            raise ValueError(f"{where}[{i}] must be an object with a non-empty string 'role', got {message!r:.80}")
        if message["role"] not in CHAT_ROLES:
            raise ValueError(f"{where}[{i}]: role must be one of {', '.join(CHAT_ROLES)}, got {message['role']!r:.80}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}[{i}] ({message['role']}) must have a string 'content', got {message!r:.80}")
        if "name" in message and not isinstance(message["name"], str):
            raise ValueError(f"{where}[{i}] ({message['role']}): 'name' must be a string, got {message['name']!r:.80}")
        checked.append({key: message[key] for key in ("role", *TEXT_FIELDS) if key in message})
    return checked


@dataclass(frozen=True)
class ChatEncoding:
    """A conversation's ids and, per id, whether it belongs to an assistant message."""

    ids: list[int]
    assistant: list[bool]

    def trained(self, train_on: str = "completion") -> list[bool]:
        """Per id, whether the loss counts it as a target: ``completion`` (the assistant's tokens), ``prompt``
        (all the others) or ``all``."""
        if train_on == "completion":
            return list(self.assistant)
        if train_on == "prompt":
            return [not a for a in self.assistant]
        if train_on == "all":
            return [True] * len(self.ids)
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")


class ChatTemplate:
    """A chat template bound to a tokenizer: :meth:`render` (text, as transformers renders it) and
    :meth:`encode` (ids and the assistant mask, contents never turned into special tokens)."""

    def __init__(self, tokenizer: Any, source: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.source = CHATML_TEMPLATE if source is None else source
        self._render = compile_template(self.source)
        eos = "<|endoftext|>" if "<|endoftext|>" in tokenizer.special_tokens else ""
        self._specials = {"bos_token": "", "eos_token": eos}
        self._edges: tuple[str, str] | None = None  # found by _assistant_edges, once _probed
        self._probed = False

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``, as transformers renders it."""
        return self._render(messages=list(messages), add_generation_prompt=add_generation_prompt, **self._specials)

    def encode(self, messages: object, where: str = "messages") -> ChatEncoding:
        """The ids of the whole conversation (``add_generation_prompt=False``) and its assistant mask."""
        messages = check_messages(messages, where)
        with render_time_limit(where):  # every render of this conversation, together
            text, fields = locate_contents(self.render, messages)
            if fields is None:
                raise ValueError(f"{where}: the chat template does not write the messages' contents as they are")
            contents = {i: (start, end) for i, key, start, end in fields if key == "content"}
            spans = self._spans_from_edges(text, messages, contents)
            if spans is None:  # a template whose assistant turns differ: every prefix rendered, quadratic work
                spans = self._spans_from_prefixes(text, messages, contents, where)
        ids: list[int] = []
        starts: list[int] = []  # each id's first character
        offsets = _char_offsets(text)
        for start, piece_ids in encode_pieces(self.tokenizer, text, [(a, b) for _, _, a, b in fields]):
            # Each id's bytes, laid end to end, are the piece's UTF-8: its first character is found from them.
            at = offsets[start]
            for token in piece_ids:
                starts.append(bisect.bisect_right(offsets, at) - 1)
                at += len(self.tokenizer.decode_bytes([token]))
            ids += piece_ids
        begins = [a for a, _ in spans]  # in order, not overlapping
        return ChatEncoding(ids, [(k := bisect.bisect_right(begins, s) - 1) >= 0 and s < spans[k][1] for s in starts])

    def _spans_from_prefixes(
        self, text: str, messages: list[dict[str, str]], contents: dict[int, tuple[int, int]], where: str
    ) -> list[tuple[int, int]]:
        """Each assistant turn's ``(start, end)`` in ``text``, from the renders of each prefix (the definition:
        the end of ``render(messages[:i], add_generation_prompt=True)`` to the end of ``render(messages[:i + 1])``).
        Two renders per assistant message, each as long as the prefix: quadratic in the messages."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, turn = self.render(messages[:i], add_generation_prompt=True), self.render(messages[: i + 1])
            if not (text.startswith(prompt) and text.startswith(turn)) or len(prompt) > contents[i][0]:
                raise ValueError(f"{where}: the chat template does not render each turn as a prefix of the next")
            spans.append((len(prompt), len(turn)))
        return spans

    def _assistant_edges(self) -> tuple[str, str] | None:
        """``(head, tail)``: what the template writes between the end of the generation prompt and an assistant's
        content, and after the content to the end of its turn, when that is the same for every assistant turn of
        a probe conversation (two assistant turns, one in the middle and one last), measured once per template
        by :meth:`_spans_from_prefixes`; None when the turns differ (or the template refuses the probe)."""
        if not self._probed:
            nonce = uuid.uuid4().hex[:12]
            probe = [{"role": role, "content": f"{role[0]}{k}{nonce}"} for k, role in
                     enumerate(("user", "assistant", "user", "assistant"))]  # fmt: skip
            edges = None
            try:
                text, fields = locate_contents(self.render, probe)
                if fields is not None:
                    contents = {i: (start, end) for i, key, start, end in fields if key == "content"}
                    spans = self._spans_from_prefixes(text, probe, contents, "the probe")
                    found = {(text[a : contents[i][0]], text[contents[i][1] : b])
                             for i, (a, b) in zip((1, 3), spans, strict=True)}  # fmt: skip
                    edges = found.pop() if len(found) == 1 else None
            except ValueError:  # the template refuses the probe: every conversation takes the prefix renders
                edges = None
            self._edges, self._probed = edges, True
        return self._edges

    def _spans_from_edges(
        self, text: str, messages: list[dict[str, str]], contents: dict[int, tuple[int, int]]
    ) -> list[tuple[int, int]] | None:
        """Each assistant turn's ``(start, end)`` in ``text`` from where its content lies and the template's
        :meth:`_assistant_edges` (no render: linear work); None when the template has no such edges or ``text``
        does not hold them around some assistant content (then the prefixes decide)."""
        edges = self._assistant_edges()
        if edges is None:
            return None
        head, tail = edges
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start, end = contents[i]
            if start < len(head) or text[start - len(head) : start] != head or text[end : end + len(tail)] != tail:
                return None
            spans.append((start - len(head), end + len(tail)))
        return spans


def locate_contents(
    render: Callable[[list[dict[str, str]]], str], messages: list[dict[str, str]]
) -> tuple[str, list[tuple[int, str, int, int]] | None]:
    """``render(messages)`` and where what users wrote lies in it: ``(message index, field, start, end)`` for each
    copy of a :data:`TEXT_FIELDS` value the template writes, in the text's order (every ``content`` once, a
    ``name`` as often as the template writes it); or None when the template does not write each content once, as
    it is, or changes a field it writes (trims it, say). Found by rendering again with a random mark in place of
    each field and putting the values back in place of the marks."""
    text = render(messages)
    nonce = uuid.uuid4().hex
    fields = [(i, key) for i, m in enumerate(messages) for key in TEXT_FIELDS if isinstance(m.get(key), str)]
    marks: dict[int, dict[str, str]] = {i: {} for i in range(len(messages))}
    for k, (i, key) in enumerate(fields):
        marks[i][key] = f"\ue000{nonce}{k}\ue001"
    marked = render([{**m, **marks[i]} for i, m in enumerate(messages)])
    spans: list[tuple[int, str, int, int]] = []
    gaps: list[str] = []
    length = position = 0
    for match in re.finditer(f"\ue000{nonce}(\\d+)\ue001", marked):
        i, key = fields[int(match.group(1))]
        value = messages[i][key]
        gaps.append(marked[position : match.start()])
        length += match.start() - position
        spans.append((i, key, length, length + len(value)))
        length += len(value)
        position = match.end()
    gaps.append(marked[position:])
    rebuilt = "".join(gap + messages[i][key] for gap, (i, key, _, _) in zip(gaps, spans, strict=False)) + gaps[-1]
    contents = sorted(i for i, key, _, _ in spans if key == "content")
    if rebuilt != text or contents != list(range(len(messages))) or any(nonce in gap for gap in gaps):
        return text, None
    return text, spans


def encode_pieces(tokenizer: Any, text: str, contents: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """``text`` as (start, ids) pieces in which special tokens are matched only outside ``contents`` (character
    spans of what users wrote, in the text's order and not overlapping, as :func:`locate_contents` gives them):
    each special token one piece, each run between two of them (template text and contents together, as
    transformers sees it) encoded as text. Their ids, joined, are ``tokenizer.encode(text)`` except that no content
    becomes a control token."""
    pieces: list[tuple[int, list[int]]] = []
    position = 0
    starts = [a for a, _ in contents]

    def text_piece(end: int) -> None:
        if end > position:
            pieces.append((position, list(tokenizer.encode(text[position:end], allowed_special="none"))))

    splitter = _splitter(list(tokenizer.special_tokens))
    for match in splitter.finditer(text) if splitter is not None else ():
        last = bisect.bisect_left(starts, match.end()) - 1  # the last span starting before the match ends
        if last >= 0 and match.start() < contents[last][1]:
            continue  # inside what a user wrote: text, not a control token
        text_piece(match.start())
        pieces.append((match.start(), list(tokenizer.encode(match.group(), allowed_special={match.group()}))))
        position = match.end()
    text_piece(len(text))
    return pieces


def _char_offsets(text: str) -> list[int]:
    """The UTF-8 byte offset where each character of ``text`` starts."""
    offsets, at = [], 0
    for char in text:
        offsets.append(at)
        at += len(char.encode("utf-8"))
    return offsets


def _splitter(specials: list[str]) -> Any:
    import regex

    if not specials:
        return None
    return regex.compile("|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)))
