"""Autoregressive generation with a KV cache: the prompt is processed once, then one token a step."""

from collections.abc import Callable

import torch
from jaxtyping import Int, Integer
from torch import Tensor

from tlm_model._checks import as_index_tensor
from tlm_model.inference import InferenceModel
from tlm_model.lm import TransformerLM


def _filter_logits(logits: Tensor, top_k: int | None, top_p: float | None) -> Tensor:
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the best always stays.
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def generate(
    model: TransformerLM | InferenceModel,
    prompt_ids: Integer[Tensor, "... prompt"],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    on_token: Callable[[int], None] | None = None,
) -> Int[Tensor, "... total"]:
    """Continue ``prompt_ids`` (shape (prompt,) or (batch, prompt)) by up to ``max_new_tokens`` tokens.

    ``temperature=0`` decodes greedily; otherwise tokens are sampled from softmax(logits /
    temperature), restricted to the ``top_k`` most likely and to the smallest set whose probability
    reaches ``top_p``. A row that emits ``eos_token_id`` stops (it is padded with that id while
    other rows go on); generation ends when every row has stopped. ``on_token(step)`` is called
    after each new token (the CLI draws its progress bar with it). Returns prompt + new tokens as
    int64, whatever integer dtype the prompt had.
    ``model`` may be the result of :func:`compile_for_inference`, the fast way to decode on CPU.
    """
    if not isinstance(prompt_ids, Tensor) or prompt_ids.ndim not in (1, 2) or prompt_ids.shape[-1] == 0:
        raise ValueError(
            "prompt_ids must be a non-empty tensor of shape (prompt,) or (batch, prompt), got "
            + (str(tuple(prompt_ids.shape)) if isinstance(prompt_ids, Tensor) else type(prompt_ids).__name__)
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    squeeze = prompt_ids.ndim == 1
    # int64 whatever the prompt's integer dtype (a uint16 memmap, say): new ids may not fit in it.
    ids = as_index_tensor("prompt_ids", prompt_ids, model.config.vocab_size, "vocab_size")
    ids = ids.unsqueeze(0) if squeeze else ids
    total = ids.shape[1] + max_new_tokens
    if total > model.config.context_length:
        raise ValueError(
            f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context_length {model.config.context_length}"
        )
    if max_new_tokens == 0:
        return (ids.squeeze(0) if squeeze else ids).clone()

    cache = model.new_kv_cache(ids.shape[0], capacity=total)
    logits = model(ids, kv_cache=cache)[:, -1]
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    out = [ids]
    for step in range(max_new_tokens):
        if temperature == 0:
            token = logits.argmax(-1)
        else:
            filtered = _filter_logits(logits.float() / temperature, top_k, top_p)
            token = torch.multinomial(torch.softmax(filtered, -1), 1, generator=generator).squeeze(-1)
        if eos_token_id is not None:
            token = torch.where(finished, eos_token_id, token)
            finished |= token == eos_token_id
        out.append(token.unsqueeze(1))
        if on_token is not None:
            on_token(step + 1)
        if step + 1 == max_new_tokens or (eos_token_id is not None and bool(finished.all())):
            break
        logits = model(token.unsqueeze(1), kv_cache=cache)[:, -1]
    result = torch.cat(out, dim=1)
    return result.squeeze(0) if squeeze else result
