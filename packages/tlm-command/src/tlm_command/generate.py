"""``tlm generate``: continue a prompt with a model, printing the text as it comes.

With a tokenizer (the checkpoint's own, or ``--tokenizer``) the prompt is text and the output is text,
decoded incrementally so that a character split across tokens prints whole; without one, ids in and
ids out. Generation ends at ``--max-new-tokens``, at ``--eos-id``, or at any ``--stop`` text (by default
the tokenizer's ``<|endoftext|>``); the stop text itself is not printed. A generation longer than the
model's context slides its window (see ``tlm_model.generate``).

``--token-healing`` (as transformers' ``generate(token_healing=True)``): the prompt's last token is backed up and
the first new token must start with its text, so a prompt that ends where training text never split (a trailing
space or newline, half a word) continues as the tokenizer would have cut the whole text. The original token is
slightly favoured (+1 on its logit, as transformers does), and the printed text starts after the prompt's.
"""

import argparse
import codecs
import json
import sys
from typing import TYPE_CHECKING, Any

from tlm_command.args import (
    UserError,
    add_command,
    add_device_arguments,
    fit_threads,
    inference_device,
    positive_int,
    say,
    seed,
    temperature,
    top_p,
    utf8_text,
)
from tlm_command.loading import add_model_arguments, load_model, load_tokenizer
from tlm_model.config import PRESETS
from tlm_tokenizer.hf_json import EOS_TOKEN

if TYPE_CHECKING:
    import torch

    from tlm_model import TransformerLM


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands, "generate", "continue a prompt (KV-cached decoding, text streamed as it comes)", __doc__
    )
    add_model_arguments(parser, required=False)
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), help="random weights of this shape instead of --checkpoint"
    )
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt as text (needs a tokenizer)")
    prompt.add_argument("--prompt-ids", metavar='"ID ID ..."', help="the prompt's token ids")
    parser.add_argument(
        "--allowed-special", choices=["all", "none"], default="all",
        help="which special-token text in --prompt becomes special tokens, as tiktoken's allowed_special (none: "
        "the text is text, as tlm serve encodes what clients send) (default: all)",
    )  # fmt: skip
    parser.add_argument("--max-new-tokens", type=positive_int, default=100, metavar="N", help="new tokens at most")
    parser.add_argument("--temperature", type=temperature, default=1.0, help="0 decodes greedily")
    parser.add_argument("--top-k", type=positive_int, default=None, metavar="K", help="sample from the K likeliest")
    parser.add_argument("--top-p", type=top_p, default=None, metavar="P", help="nucleus sampling, in (0, 1]")
    parser.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help=f"end when this text appears (repeatable; default {EOS_TOKEN} when the tokenizer has "
        "it; --stop '' for none)",
    )
    parser.add_argument(
        "--eos-id",
        default=None,
        metavar="ID",
        help="end when this token is generated: an id, or a special token such as <|endoftext|>",
    )
    parser.add_argument(
        "--token-healing",
        action="store_true",
        help="back up the prompt's last token; the first new token must start with its text (needs a tokenizer)",
    )
    parser.add_argument("--seed", type=seed, default=0, help="seeds the sampler (and random weights)")
    add_device_arguments(parser, "weights' dtype (default: the checkpoint's; float32 for random weights)")
    parser.add_argument("--compile", action="store_true", help="compile_for_inference first (faster long runs on CPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def _ids(text: str) -> list[int]:
    try:
        ids = [int(tok) for tok in text.replace(",", " ").split()]
    except ValueError:
        raise UserError(f"--prompt-ids must be integers separated by spaces or commas, got {text!r}") from None
    if not ids:
        raise UserError("--prompt-ids is empty; give at least one token id")
    return ids


def _model(args: argparse.Namespace, device: "torch.device") -> "tuple[TransformerLM, Any]":
    import torch

    if args.checkpoint is None:
        if args.preset is None:
            raise UserError("generate needs --checkpoint PATH (or --preset NAME for random weights)")
        from tlm_core.tensors import dtype_from_name
        from tlm_model import TransformerLM

        torch.manual_seed(args.seed)
        dtype = dtype_from_name(args.dtype) if args.dtype else None
        model = TransformerLM.from_preset(args.preset, device=device, dtype=dtype).eval()
        return model, load_tokenizer(args.tokenizer, None)
    if args.preset is not None:
        raise UserError("--preset builds random weights; a --checkpoint carries its own shape: give one of them")
    model, tokenizer, _ = load_model(args, device)
    return model, tokenizer


def _eos(args: argparse.Namespace, tokenizer: Any, vocab: int) -> list[int] | None:
    if args.eos_id is None:
        return None
    text = args.eos_id
    if text.lstrip("-").isdigit():
        eos = int(text)
    elif tokenizer is not None and text in tokenizer.special_tokens:
        eos = tokenizer.encode(text)[0]
    else:
        raise UserError(f"--eos-id must be a token id or one of the tokenizer's special tokens, got {text!r}")
    if not 0 <= eos < vocab:
        raise UserError(f"--eos-id must be in [0, {vocab}) for this model's vocabulary, got {eos}")
    return [eos]


#: The logit added to the backed-up token itself among the first token's candidates (transformers' own figure),
#: so that healing changes the prompt's last token only when the model prefers a longer one.
HEALING_FAVOUR = 1.0


def heal_prompt(tokenizer: Any, prompt: list[int]) -> tuple[list[int], bytes, list[int]]:
    """Token healing's prompt side: (the prompt without its last token, that token's bytes, the ids whose bytes
    start with them: the candidates for the first new token, the removed one among them). Special tokens are
    never candidates, and a special or only token is not backed up (the prompt comes back whole, with b"" and [])."""
    specials = {tokenizer.encode(s)[0] for s in tokenizer.special_tokens}
    if len(prompt) < 2 or prompt[-1] in specials:
        return prompt, b"", []
    tail = tokenizer.decode_bytes([prompt[-1]])
    table = tokenizer.vocab
    allowed = [i for i in sorted(table) if i not in specials and table[i].startswith(tail)]
    return prompt[:-1], tail, allowed


def _healed_first_token(model: Any, prompt: list[int], last: int, allowed: list[int], args: Any, generator: Any) -> int:
    """The first new token of a healed prompt: the model's next-token logits on ``prompt`` restricted to
    ``allowed`` (the backed-up token ``last`` favoured by :data:`HEALING_FAVOUR`), then the usual sampling."""
    import torch

    from tlm_model.generate import sample_next_token

    context = model.config.context_length
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor(prompt[-context:], device=device)[None])[0, -1].float()
    mask = torch.full_like(logits, -torch.inf)
    mask[torch.tensor(allowed, device=device)] = 0.0
    mask[last] += HEALING_FAVOUR
    token = sample_next_token(
        logits + mask, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, generator=generator
    )
    return int(token)


class _Stream:
    """Prints the continuation as it comes: text through an incremental UTF-8 decoder (a character
    split across tokens prints once whole), held back by the length of the longest stop text so that
    a stop text split across tokens is found before any of it is printed."""

    def __init__(self, tokenizer: Any, stops: list[str], out: Any, skip: bytes = b"") -> None:
        self.tokenizer, self.stops, self.out = tokenizer, [s for s in stops if s], out
        self.skip = len(skip)  # the first bytes of the output that the prompt already holds (token healing)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending, self.text = "", ""
        self.ids: list[int] = []
        self.hold = max(map(len, self.stops), default=1) - 1
        self.stopped = False

    def add(self, ids: "torch.Tensor") -> bool:
        token = int(ids)
        self.ids.append(token)
        if self.tokenizer is None:
            self._emit(f"{token} ")
            return False
        data = self.tokenizer.decode_bytes([token])
        data, self.skip = data[self.skip :], max(0, self.skip - len(data))
        self.pending += self.decoder.decode(data)
        for stop in self.stops:
            at = self.pending.find(stop)
            if at >= 0:
                self._emit(self.pending[:at])
                self.pending, self.stopped = "", True
                return True
        if len(self.pending) > self.hold:
            cut = len(self.pending) - self.hold
            self._emit(self.pending[:cut])
            self.pending = self.pending[cut:]
        return False

    def close(self) -> None:
        if self.tokenizer is not None and not self.stopped:
            self._emit(self.pending + self.decoder.decode(b"", final=True))
        if self.out is not None:
            self.out.write("\n")
            self.out.flush()

    def _emit(self, text: str) -> None:
        self.text += text
        if self.out is not None and text:
            self.out.write(text)
            self.out.flush()


def _prompt(args: argparse.Namespace, tokenizer: Any, vocab: int, context: int) -> list[int]:
    """The prompt's ids (``--prompt`` encoded, or ``--prompt-ids``), each in the vocabulary; a prompt longer than
    the context is said to be cut to its newest tokens (unless ``--quiet``)."""
    if args.prompt is not None:
        if tokenizer is None:
            raise UserError(
                "--prompt needs a tokenizer: this checkpoint has none; give --tokenizer DIR or --prompt-ids"
            )
        prompt = tokenizer.encode(args.prompt, allowed_special=args.allowed_special)
        if not prompt:
            raise UserError("--prompt is empty; give some text")
    else:
        prompt = _ids(args.prompt_ids)
    if bad := [i for i in prompt if not 0 <= i < vocab]:
        raise UserError(f"--prompt-ids must be in [0, {vocab}) for this model's vocabulary, got {bad[:5]}")
    if len(prompt) > context and not args.quiet:
        from tlm_model.generate import sliding_window  # the rule generate() keeps the newest tokens by

        kept = sliding_window(context)[0]
        say(
            f"the prompt has {len(prompt)} tokens, more than the model's context of {context}: generating from its "
            f"last {kept} (the window keeps room for new tokens)"
        )
    return prompt


def run(args: argparse.Namespace) -> int:
    import torch

    from tlm_core.progress import progress_bar
    from tlm_model import compile_for_inference, generate

    for flag, texts in (("--prompt", [args.prompt] if args.prompt is not None else []), ("--stop", args.stop or [])):
        for text in texts:
            utf8_text(flag, text)  # before any work: bytes that are not UTF-8 no tokenizer can take
    device = inference_device(args)
    fit_threads(device, quiet=args.quiet)
    model, tokenizer = _model(args, device)
    vocab = model.config.vocab_size
    prompt = _prompt(args, tokenizer, vocab, model.config.context_length)
    eos = _eos(args, tokenizer, vocab)
    stops = (
        args.stop
        if args.stop is not None
        else ([EOS_TOKEN] if tokenizer and EOS_TOKEN in tokenizer.special_tokens else [])
    )
    if tokenizer is None and any(stops):
        raise UserError("--stop TEXT needs a tokenizer to see text; use --eos-id ID with token ids")
    if tokenizer is not None:
        # A stop text that is one special token ends generation at that token: no need to decode it.
        special = [tokenizer.encode(s)[0] for s in stops if s in tokenizer.special_tokens]
        eos = (eos or []) + [i for i in special if i < vocab] or None
    removed, last = b"", -1
    allowed: list[int] = []
    if args.token_healing:
        if tokenizer is None:
            raise UserError("--token-healing needs a tokenizer to see the prompt's text; give --tokenizer DIR")
        last = prompt[-1]
        prompt, removed, allowed = heal_prompt(tokenizer, prompt)
    eager = model
    if args.compile:
        model = compile_for_inference(model)  # type: ignore[assignment]
    stream = _Stream(tokenizer, stops, None if args.json else sys.stdout, skip=removed)
    show = False if args.quiet else (None if not sys.stdout.isatty() or args.json else False)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    with progress_bar(show, total=args.max_new_tokens, unit="tok", desc="generating") as bar:

        def on_token(ids: "torch.Tensor") -> bool:
            bar.update()
            return stream.add(ids)

        try:
            given, budget = list(prompt), args.max_new_tokens
            if allowed:  # the first token chosen among the backed-up one's extensions, then decoding as usual
                first = _healed_first_token(eager, prompt, last, allowed, args, generator)
                given, budget = [*prompt, first], budget - 1
                if on_token(torch.tensor(first)) or (eos is not None and first in eos):
                    budget = 0
            out = generate(
                model,
                torch.tensor(given, device=device),
                budget,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                eos_token_id=eos,
                generator=generator,
                on_token=on_token,
            )
        finally:
            stream.close()
    if args.json:
        new = out[len(prompt) :].tolist()
        print(json.dumps({"prompt_ids": prompt, "ids": new, "text": stream.text if tokenizer is not None else None}))
    return 0
