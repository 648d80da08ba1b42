"""How ``tlm serve`` turns a batch of rows' logits into next tokens and log-probabilities: every row with its own
sampling parameters, held as tensors of per-row values (:class:`RowParams`), so one call serves the whole batch.

Two functions, each the one place of its job:

- :func:`sample_rows`: OpenAI's ``frequency_penalty`` and ``presence_penalty`` (over the tokens each row has
  generated so far), ``logit_bias``, then greedy (``temperature`` 0) or a draw from softmax(logits / temperature)
  cut to ``top_p``, each sampled row with its own ``torch.Generator``, through :func:`tlm_model.sample_tokens` (one
  call for the batch). A row without penalties or bias, at temperature t and top_p p, draws exactly what
  :func:`tlm_model.sample_next_token` draws (``tlm generate``).
- :func:`token_logprobs`: the log-probabilities OpenAI reports: ``log_softmax`` of the model's logits in float32,
  before temperature, penalties and bias, for the chosen token and the top k.

Nothing here reads a value back to the host: which rows sample and whether any row has penalties are known from
the requests (plain Python values), not from the tensors.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from tlm_model import sample_tokens

#: A temperature below this is greedy. softmax(logits / t) in float32 overflows to inf (then NaN) once
#: logits / t passes 3.4e38, and already at t = 1e-5 a gap of 0.001 between two logits is a factor of e^100:
#: vLLM's cut-off (``_SAMPLING_EPS``), checked where the request arrives.
GREEDY_BELOW = 1e-5


@dataclass
class RowParams:
    """Per-row sampling parameters, one entry per row of the batch (all on the logits' device).

    ``temperature`` 0 is greedy; ``top_p`` above 1 (or exactly 1) keeps every token; ``bias`` and ``counts`` are
    None when no row of the batch has a logit_bias or a penalty; ``counts`` is the generated-token counts.
    """

    temperature: Tensor  # (batch,) float32
    top_p: Tensor  # (batch,) float32
    presence: Tensor  # (batch,) float32
    frequency: Tensor  # (batch,) float32
    bias: Tensor | None = None  # (batch, vocab) float32
    counts: Tensor | None = None  # (batch, vocab) float32
    sampled: Tensor | None = None  # (sampled rows,) long: the rows that draw (the others are greedy)


def adjusted_logits(logits: Tensor, params: RowParams) -> Tensor:
    """``logits`` in float32 with each row's penalties and logit_bias applied (OpenAI's definitions:
    ``logit - count * frequency_penalty - (count > 0) * presence_penalty + bias``)."""
    x = logits.float()
    if params.counts is not None:
        counts = params.counts
        x = x - counts * params.frequency[:, None] - (counts > 0).float() * params.presence[:, None]
    if params.bias is not None:
        x = x + params.bias
    return x


def sample_rows(
    logits: Tensor,
    params: RowParams,
    generators: list[torch.Generator | None],
    *,
    any_top_p: bool,
) -> Tensor:
    """The next token of every row of ``logits`` (batch, vocab): greedy where ``generators[r]`` is None (the row's
    temperature is 0), else a draw with that generator. ``any_top_p``: some sampled row has top_p < 1."""
    x = adjusted_logits(logits, params)
    if all(generator is None for generator in generators):
        return x.argmax(-1)
    # tlm_model's batched sampler: one call for every row, each seeded row's noise from its own generator; a
    # greedy row (no generator) gets temperature 0.
    sampled = [r for r, generator in enumerate(generators) if generator is not None]
    rows = params.sampled if params.sampled is not None else torch.tensor(sampled, device=x.device)
    temperature = torch.zeros_like(params.temperature).index_copy(0, rows, params.temperature[rows])
    return sample_tokens(x, temperature, None, params.top_p if any_top_p else None, generators)


def token_logprobs(logits: Tensor, chosen: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    """(log-probability of ``chosen``, the ``top`` best log-probabilities, their ids), per position of ``logits``
    (``..., vocab``; ``chosen`` is ``...``): ``log_softmax`` of the raw logits in float32, before temperature,
    penalties and bias, as OpenAI reports them. ``top`` may be 0 (empty top tensors)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    best = logp.topk(top, dim=-1)
    return picked, best.values, best.indices
