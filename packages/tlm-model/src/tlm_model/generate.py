"""Autoregressive generation with a KV cache: the prompt is processed once, then one token a step."""

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from jaxtyping import Float, Int, Integer
from torch import Tensor

from tlm_core.checks import check_int, check_number, check_positive_int
from tlm_core.tensors import as_index_tensor
from tlm_model.inference import InferenceModel
from tlm_model.lm import TransformerLM

if TYPE_CHECKING:
    from tlm_attention import KVCache
    from tlm_model.batching import DecodeBatch


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

    Every model decodes through a :class:`~tlm_model.batching.DecodeBatch` over static caches, allocated
    once per model and kept for the next call (new ones only for more rows, longer sequences, or weights
    moved to another dtype or device). ``model`` may be the result of :func:`compile_for_inference`, the fast
    way to decode: one compiled graph of one shape then serves every step (a window that slides rebuilds a
    full row alone; the tokens are those of the eager model, up to float rounding).

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
    eos_ids = None if eos is None else torch.tensor(eos, device=ids.device)
    check_every = 1 if on_token is not None else EOS_CHECK_EVERY
    batch = _batch_for(model, ids.shape[0], min(max(lengths) + max_new_tokens, context))
    width, (keep, _) = ids.shape[1], sliding_window(context)
    rows = [ids[b, width - n :] for b, n in enumerate(lengths)]
    prompts = [row if len(row) <= batch.capacity else row[-keep:] for row in rows]
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    all_done_at = torch.full((), -1, device=ids.device)  # the step at which every row had ended
    out = [ids]
    try:
        # Every prompt in one forward (as a full forward over the padded prompts would), however many rows.
        logits = cast(Tensor, batch.add_many(prompts, budget=max(batch.prefill_chunk, sum(map(len, prompts)))))
        for step in range(max_new_tokens):
            token = sample_next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            if eos_ids is not None:  # on the device: a finished row keeps emitting eos[0]
                token = torch.where(finished, eos_ids[0], token)
                finished |= torch.isin(token, eos_ids)
                all_done_at = torch.where((all_done_at < 0) & finished.all(), step, all_done_at)
            out.append(token.unsqueeze(1))
            stop = bool(on_token(token[0] if squeeze else token)) if on_token is not None else False
            ended = eos_ids is not None and (step + 1) % check_every == 0 and bool(finished.all())
            if stop or step + 1 == max_new_tokens or ended:
                break
            # A row that fills the caches (only at the context: the capacity is then the context) is refilled alone
            # from its newest tokens but the one it is about to take, then takes it with the others.
            if full := [b for b, n in enumerate(batch.lengths) if n == batch.capacity]:
                before = torch.cat(out[:-1], dim=1)
                for b in full:
                    row = before[b, width - lengths[b] :]
                    batch.refill(b, row[len(row) - (keep - 1) :])
            logits = batch.step(token)
    finally:
        batch.clear()
        _CACHES[model] = batch.cache  # kept for the next call
    result = torch.cat(out, dim=1)
    if eos_ids is not None and check_every > 1 and (done := int(all_done_at)) >= 0:  # cut the steps past the end
        result = result[:, : width + done + 1]
    return result.squeeze(0) if squeeze else result


#: Each model's static caches, kept between calls of :func:`generate` (they hold no reference to the model).
_CACHES: "weakref.WeakKeyDictionary[Any, KVCache]" = weakref.WeakKeyDictionary()


def _batch_for(model: TransformerLM | InferenceModel, rows: int, capacity: int) -> "DecodeBatch":
    """A :class:`DecodeBatch` of ``model`` for ``rows`` rows of ``capacity`` tokens, over the caches kept from
    an earlier call when they have room (allocated once and reused), else over new ones, kept instead. For a
    compiled model the capacity is rounded up to a power of two (at least 64, at most the context): requests of
    similar lengths share caches and one compiled step. Kept caches leave the table while they are in use
    (another thread decoding the same model meanwhile gets caches of its own)."""
    from tlm_model.batching import DecodeBatch

    if isinstance(model, InferenceModel):  # the capacity is a compiled step's shape
        capacity = min(model.config.context_length, max(64, 1 << (capacity - 1).bit_length()))
    cache = _CACHES.pop(model, None)
    weight = model.lm_head.weight if isinstance(model, TransformerLM) else model.model.lm_head.weight
    if cache is not None and (
        cache.max_batch_size >= rows
        and cache.capacity >= capacity
        and (cache.dtype, cache.device) == (weight.dtype, weight.device)
    ):
        return DecodeBatch(model, cache.max_batch_size, cache=cache)
    return DecodeBatch(model, rows, capacity=capacity)


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
