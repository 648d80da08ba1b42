"""Autoregressive generation with a KV cache: the prompt is processed once, then one token a step."""

from collections.abc import Callable, Sequence
from typing import cast

import torch
from jaxtyping import Float, Int, Integer
from torch import Tensor

from tlm_core.checks import check_int, check_number, check_positive_int
from tlm_core.tensors import as_index_tensor
from tlm_model.inference import InferenceModel
from tlm_model.lm import TransformerLM


def _filter_logits(logits: Tensor, top_k: int | Tensor | None, top_p: float | Tensor | None) -> Tensor:
    """``logits`` with -inf outside each row's ``top_k`` most likely (ties at the k-th kept; 0 or >= vocab: no
    limit) and outside the smallest set whose probability reaches ``top_p`` (1: no limit). Each limit is one
    value or one per row (a tensor of the leading shape); one sort serves both."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    ordered, order = logits.sort(-1, descending=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if top_k is not None:
        k = torch.as_tensor(top_k, device=logits.device).long().unsqueeze(-1)
        k = torch.where((k > 0) & (k < vocab), k, vocab)
        keep &= ordered >= ordered.gather(-1, (k - 1).expand(*ordered.shape[:-1], 1))
    if top_p is not None:
        p = torch.as_tensor(top_p, device=logits.device, dtype=torch.float32).unsqueeze(-1)
        probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")).float(), -1)
        # Drop a token when the tokens ranked above it already reach top_p; the best always stays.
        keep &= (probs.cumsum(-1) - probs < p) | (p >= 1.0)
    return logits.masked_fill(~torch.zeros_like(keep).scatter(-1, order, keep), float("-inf"))


#: Without an ``on_token`` callback (which reads every token anyway), :func:`generate` asks the device whether
#: every row has ended once every this many steps, not every step, and cuts the steps past the end afterwards.
EOS_CHECK_EVERY = 8


def sliding_window(context_length: int) -> tuple[int, int]:
    """(tokens kept, tokens dropped) when a full window slides: a quarter of the context is dropped, so
    the cache is rebuilt once every context_length // 4 tokens and each token still sees at least
    three quarters of the context."""
    shift = max(1, context_length // 4)
    return context_length - shift, shift


@torch.no_grad()
def generate(
    model: TransformerLM | InferenceModel,
    prompt_ids: Integer[Tensor, "... prompt"],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    on_token: Callable[[Tensor], bool | None] | None = None,
    prompt_lengths: Sequence[int] | None = None,
) -> Int[Tensor, "... total"]:
    """Continue ``prompt_ids`` (shape (prompt,) or (batch, prompt)) by up to ``max_new_tokens`` tokens.

    ``temperature=0`` decodes greedily; otherwise tokens are sampled from softmax(logits /
    temperature), restricted to the ``top_k`` most likely and to the smallest set whose probability
    reaches ``top_p``. A row that emits one of ``eos_token_id`` (an id or several) stops (it is padded
    with the first of them while other rows go on); generation ends when every row has stopped.
    ``on_token(ids)`` is called with each step's new token ids (int64, shape (batch,), or () for a 1-D
    prompt); if it returns True, generation ends there (a caller's stop string, say). Returns prompt +
    new tokens as int64, whatever integer dtype the prompt had.

    **Longer than the context.** The model sees at most ``context_length`` tokens. A prompt longer
    than that keeps its newest tokens, and when the window is full it slides: the KV cache is rebuilt
    from the newest ``context_length - context_length // 4`` tokens, so each new token is predicted from
    at least three quarters of a full context and the rebuild costs one prefill every
    ``context_length // 4`` tokens. Within the context nothing slides and the result is exact.

    **Prompts of different lengths.** ``prompt_lengths`` (one int per row) says how many of each row's
    ids are its prompt: the rows are *left*-padded, row ``b``'s prompt being its last ``prompt_lengths[b]``
    ids, and the padding ids are returned as they came, before the prompt. Each row keeps its own
    positions in the KV cache, so row ``b`` gets the tokens its prompt gets alone (up to float rounding of
    a batched matmul), and slides its own window when it alone fills the context.

    ``model`` may be the result of :func:`compile_for_inference`, the fast way to decode: it then decodes
    through a :class:`~tlm_model.batching.DecodeBatch` over static caches sized to the request, one compiled
    graph of one shape for every step (a window that slides rebuilds a full row alone; the tokens are those
    of the eager model, up to float rounding).

    **Host syncs.** A step reads nothing back unless ``on_token`` is given (it gets each token) or
    ``eos_token_id`` is: then whether every row has ended is read every step with ``on_token``, else every
    :data:`EOS_CHECK_EVERY` steps, and the few steps run past the end are cut from the result.
    """
    if not isinstance(prompt_ids, Tensor) or prompt_ids.ndim not in (1, 2) or prompt_ids.shape[-1] == 0:
        raise ValueError(
            "prompt_ids must be a non-empty tensor of shape (prompt,) or (batch, prompt), got "
            + (str(tuple(prompt_ids.shape)) if isinstance(prompt_ids, Tensor) else type(prompt_ids).__name__)
        )
    check_int("max_new_tokens", max_new_tokens, low=0)
    check_number("temperature", temperature, low=0.0)
    if top_k is not None:
        check_positive_int("top_k", top_k)
    if top_p is not None:
        check_number("top_p", top_p, low=0.0, high=1.0, low_open=True)
    vocab, context = model.config.vocab_size, model.config.context_length
    eos = _eos_ids(eos_token_id, vocab)
    squeeze = prompt_ids.ndim == 1
    # int64 whatever the prompt's integer dtype (a uint16 memmap, say): new ids may not fit in it.
    ids = as_index_tensor("prompt_ids", prompt_ids, vocab, "vocab_size")
    ids = ids.unsqueeze(0) if squeeze else ids
    lengths = _prompt_lengths(prompt_lengths, ids.shape)
    if max_new_tokens == 0:
        return (ids.squeeze(0) if squeeze else ids).clone()
    keep, _ = sliding_window(context)
    width = ids.shape[1]
    capacity = min(max(lengths) + max_new_tokens, context)

    def prefill(tokens: Tensor) -> tuple[list, Tensor]:
        cache = model.new_kv_cache(tokens.shape[0], capacity=capacity)
        return cache, model(tokens, kv_cache=cache)[:, -1]

    def prefill_rows(rows: list[Tensor]) -> tuple[list, Tensor]:
        # Right-padded for the prefill (a padded token comes after every real one, so no real token
        # sees it); then each row's cache is cut back to its own length and its last real token's
        # logits kept. The slots of the padding are overwritten by the row's next tokens.
        sizes = [len(row) for row in rows]
        padded = torch.zeros(len(rows), max(sizes), dtype=ids.dtype, device=ids.device)
        for b, row in enumerate(rows):
            padded[b, : len(row)] = row
        cache = model.new_kv_cache(len(rows), capacity=capacity)
        all_logits = model(padded, kv_cache=cache)
        for layer in cache:
            layer.truncate(sizes)
        return cache, all_logits[torch.arange(len(rows), device=ids.device), torch.tensor(sizes, device=ids.device) - 1]

    eos_tensor = None if eos is None else torch.tensor(eos, device=ids.device)
    check_every = 1 if on_token is not None else EOS_CHECK_EVERY
    if _uses_static_cache(model):
        static = _generate_static(
            model, ids, lengths, capacity, max_new_tokens, eos_tensor, on_token, check_every, squeeze,
            dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator),
        )  # fmt: skip
        return static.squeeze(0) if squeeze else static
    ragged = any(n != width for n in lengths)
    if not ragged:
        cache, logits = prefill(ids if width <= capacity else ids[:, -keep:])
    else:
        # A prompt longer than the context keeps its newest tokens, as a lone prompt does.
        rows = [ids[b, width - n :] for b, n in enumerate(lengths)]
        cache, logits = prefill_rows([row if len(row) <= capacity else row[-keep:] for row in rows])
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    all_done_at = torch.full((), -1, device=ids.device)  # the first step after which every row had ended
    out = [ids]
    for step in range(max_new_tokens):
        token = sample_next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if eos_tensor is not None:
            token, all_done_at = _track_end(token, finished, eos_tensor, all_done_at, step)
        out.append(token.unsqueeze(1))
        stop = bool(on_token(token[0] if squeeze else token)) if on_token is not None else False
        ended = eos_tensor is not None and (step + 1) % check_every == 0 and bool(finished.all())
        if stop or step + 1 == max_new_tokens or ended:
            break
        if not ragged and cache[0].length == capacity:  # the window is full: rebuild it from its newest tokens
            cache, logits = prefill(torch.cat(out, dim=1)[:, -keep:])
            continue
        if ragged and cache[0].length == capacity:
            # Each full row alone is rebuilt from its newest tokens but the one it is about to take.
            before = torch.cat(out[:-1], dim=1)
            for b, n in enumerate(cache[0].lengths):
                if n == capacity:
                    row = before[b, width - lengths[b] :]
                    _rebuild_row(model, cache, b, row[len(row) - (keep - 1) :])
        logits = model(token.unsqueeze(1), kv_cache=cache)[:, -1]
    result = _cut_after_the_end(torch.cat(out, dim=1), all_done_at, width, eos_tensor, check_every)
    return result.squeeze(0) if squeeze else result


def _uses_static_cache(model: object) -> bool:
    """Whether :func:`generate` decodes ``model`` over static caches (a compiled model's one step shape)."""
    return isinstance(model, InferenceModel)


def _cut_after_the_end(result: Tensor, all_done_at: Tensor, width: int, eos: Tensor | None, check_every: int) -> Tensor:
    """``result`` without the steps run after every row had ended (at most ``check_every - 1``): one read."""
    if eos is None or check_every == 1:
        return result
    done = int(all_done_at)
    return result if done < 0 else result[:, : width + done + 1]


def _generate_static(
    model: InferenceModel | TransformerLM,
    ids: Tensor,
    lengths: list[int],
    capacity: int,
    max_new_tokens: int,
    eos: Tensor | None,
    on_token: Callable[[Tensor], bool | None] | None,
    check_every: int,
    squeeze: bool,
    sampling: dict,
) -> Tensor:
    """:func:`generate`'s loop over a :class:`DecodeBatch` (static caches, one step shape): what an
    :class:`InferenceModel` decodes with. A full row (only at the context: ``capacity`` is then the context)
    is refilled alone from its newest tokens but the one it is about to take, then takes it with the others."""
    from tlm_model.batching import DecodeBatch

    width = ids.shape[1]
    context = model.config.context_length
    keep, _ = sliding_window(context)
    # The caches' capacity is a step's shape: rounded up to a power of two (at least 64, at most the context),
    # requests of similar lengths share one compiled step. A window still slides only at the context.
    capacity = min(context, max(64, 1 << (capacity - 1).bit_length()))
    batch = DecodeBatch(model, ids.shape[0], capacity=capacity)
    rows = [ids[b, width - n :] for b, n in enumerate(lengths)]
    logits = cast(Tensor, batch.add_many([row if len(row) <= capacity else row[-keep:] for row in rows]))
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    all_done_at = torch.full((), -1, device=ids.device)
    out = [ids]
    for step in range(max_new_tokens):
        token = sample_next_token(logits, **sampling)
        if eos is not None:
            token, all_done_at = _track_end(token, finished, eos, all_done_at, step)
        out.append(token.unsqueeze(1))
        stop = bool(on_token(token[0] if squeeze else token)) if on_token is not None else False
        ended = eos is not None and (step + 1) % check_every == 0 and bool(finished.all())
        if stop or step + 1 == max_new_tokens or ended:
            break
        full = [b for b, n in enumerate(batch.lengths) if n == capacity]
        if full:
            before = torch.cat(out[:-1], dim=1)
            for b in full:
                row = before[b, width - lengths[b] :]
                batch.refill(b, row[len(row) - (keep - 1) :])
        logits = batch.step(token)
    return _cut_after_the_end(torch.cat(out, dim=1), all_done_at, width, eos, check_every)


def sample_next_token(
    logits: Float[Tensor, "... vocab"],
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Int[Tensor, "..."]:
    """The next token of each row of ``logits``: the argmax at ``temperature=0``, else a draw from
    softmax(logits / temperature) restricted by ``top_k`` and ``top_p`` (what :func:`generate` does each step):
    :func:`sample_tokens` with the same settings for every row and one ``generator`` for all of them.

    Arguments are not checked here (a decoding loop calls this every step): :func:`generate` checks them.
    """
    if temperature == 0:
        return logits.argmax(-1)
    flat = logits.reshape(-1, logits.shape[-1])
    return sample_tokens(flat, temperature, top_k, top_p, generator).reshape(logits.shape[:-1])


def sample_tokens(
    logits: Float[Tensor, "batch vocab"],
    temperature: float | Sequence[float] | Tensor,
    top_k: int | Sequence[int | None] | Tensor | None = None,
    top_p: float | Sequence[float | None] | Tensor | None = None,
    generators: torch.Generator | Sequence[torch.Generator | None] | None = None,
) -> Int[Tensor, " batch"]:
    """One token for every row of ``logits`` in one call, each row with its own settings: a row with
    temperature 0 takes its argmax; another draws from softmax(logits / temperature) restricted to its
    ``top_k`` most likely tokens (ties at the k-th kept; None or 0: no limit) and to the smallest set whose
    probability reaches its ``top_p`` (None or 1: no limit). Each setting is one value for every row or one
    per row (a sequence, or a tensor on the logits' device).

    The draw is the exponential race (argmax of p / E, E ~ Exp(1) drawn per token; as vLLM and gpt-fast
    sample without a host sync), whose winner is distributed as p exactly. ``generators`` is one generator for
    every row, or one per row: a row with its own generator draws its noise from it alone, so its tokens do
    not depend on what else is in the batch; rows with None share torch's default generator. Nothing is
    checked or read back here (a server's hot path): the caller validates the settings once per request.
    """
    rows = logits.shape[0]
    device = logits.device
    logits = logits.float()

    def per_row(value: object, dtype: torch.dtype, none: float) -> Tensor:
        if isinstance(value, Tensor):
            return value.to(device, dtype)
        if isinstance(value, Sequence):
            return torch.tensor([none if v is None else v for v in value], dtype=dtype, device=device)
        return torch.full((rows,), none if value is None else cast(float, value), dtype=dtype, device=device)

    temperatures = per_row(temperature, torch.float32, 0.0)
    scaled = logits / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
    scaled = _filter_logits(
        scaled,
        None if top_k is None else per_row(top_k, torch.int64, 0),
        None if top_p is None else per_row(top_p, torch.float32, 1.0),
    )
    probs = torch.softmax(scaled, -1)
    noise = torch.empty_like(probs)
    if isinstance(generators, torch.Generator) or generators is None:
        noise.exponential_(generator=generators)
    else:
        if any(g is None for g in generators):
            noise.exponential_()
        for row, g in enumerate(generators):
            if g is not None:
                noise[row].exponential_(generator=g)
    # A draw of exactly 0 would make 0/0 of a dropped token: the smallest normal float instead.
    drawn = (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(-1)
    return torch.where(temperatures > 0, drawn, logits.argmax(-1))


def _rebuild_row(model: TransformerLM | InferenceModel, cache: list, row: int, tokens: Tensor) -> None:
    """Row ``row`` of every layer's cache holds exactly ``tokens``'s keys and values (a slid window)."""
    if len(tokens) == 0:
        lengths = list(cache[0].lengths)
        lengths[row] = 0
        for layer in cache:
            layer.truncate(lengths)
        return
    alone = model.new_kv_cache(1, capacity=len(tokens))
    model(tokens.unsqueeze(0), kv_cache=alone)
    for layer, source in zip(cache, alone, strict=True):
        layer.set_row(row, source)


def _prompt_lengths(prompt_lengths: Sequence[int] | None, shape: torch.Size) -> list[int]:
    batch, width = shape
    if prompt_lengths is None:
        return [width] * batch
    if isinstance(prompt_lengths, Tensor):
        prompt_lengths = prompt_lengths.tolist()
    if isinstance(prompt_lengths, (str, bytes)) or not isinstance(prompt_lengths, Sequence):
        raise TypeError(f"prompt_lengths must be a sequence of ints, one per row, got {type(prompt_lengths).__name__}")
    if len(prompt_lengths) != batch:
        raise ValueError(f"prompt_lengths must hold one int per row ({batch}), got {len(prompt_lengths)}")
    return [check_int("prompt_lengths", n, low=1, high=width) for n in prompt_lengths]


def _eos_ids(eos_token_id: int | Sequence[int] | None, vocab: int) -> list[int] | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids:
        raise TypeError(f"eos_token_id must be a token id, a non-empty sequence of them, or None, got {eos_token_id!r}")
    for i in ids:
        check_int("eos_token_id", i, low=0, high=vocab - 1)
    return list(ids)


def _track_end(token: Tensor, finished: Tensor, eos: Tensor, all_done_at: Tensor, step: int) -> tuple[Tensor, Tensor]:
    """One decoding step's end-of-text bookkeeping, on the device: a finished row keeps emitting ``eos[0]``,
    ``finished`` (updated in place) gains the rows that just ended, and ``all_done_at`` becomes ``step`` the
    first time every row has ended. Returns the token and ``all_done_at``."""
    token = torch.where(finished, eos[0], token)
    finished |= torch.isin(token, eos)
    return token, torch.where((all_done_at < 0) & finished.all(), step, all_done_at)
