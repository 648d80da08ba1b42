"""LM head and cross-entropy fused over token chunks.

For a vocabulary of 50k, float32 logits of 1,024 tokens take 206 MB, and autograd keeps them, the
log-softmax and their gradient alive together. Here each chunk's logits live only while its loss
and its gradients with respect to the hidden states and the head weight are computed (the
gradient is taken during the forward pass, as Liger-Kernel's fused linear cross-entropy does), so
peak memory grows with ``chunk_size × vocab`` instead of ``tokens × vocab``.

Under autocast every GEMM here runs in the autocast dtype, as the rest of the model's do: the logits
``h @ Wᵀ``, the hidden-state gradient ``G @ W`` and the head's gradient ``Gᵀ @ h`` (an out-of-place
``mm`` added into a float32 accumulator: autocast does not cast ``out=`` or in-place ops, and an
``addmm`` would cast the accumulator itself). The softmax, the loss and the head's gradient sum stay in
float32. Without autocast the gradients are written by the GEMMs themselves (``out=``, ``addmm_``).
"""

import torch
from jaxtyping import Float, Integer
from torch import Tensor

#: A target that the loss skips (prompt tokens of a chat example, padding): torch's and HF's ignore_index.
IGNORE_INDEX = -100
#: Integer dtypes that gather does not take, widened to int64 (never read as a mask).
_WIDEN = frozenset({torch.uint8, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64})


def _chunked_loss(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int, want_hidden: bool, want_weight: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The mean loss (in float32, or float64 for float64 input) and, only when asked for, its
    gradients with respect to ``hidden`` and ``weight``, a chunk of tokens at a time."""
    n = hidden.shape[0]
    grad_hidden = torch.empty_like(hidden) if want_hidden else None
    compute = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for float64 input
    grad_weight = torch.zeros_like(weight, dtype=compute) if want_weight else None
    total = torch.zeros((), dtype=compute, device=hidden.device)
    kept = targets != IGNORE_INDEX
    count = kept.sum().clamp_min(1).to(compute)  # the targets that count, on the device (no host read)
    autocast = torch.is_autocast_enabled(hidden.device.type)
    for start in range(0, n, chunk_size):
        h = hidden[start : start + chunk_size]
        k = kept[start : start + chunk_size].unsqueeze(1)
        t = torch.where(k.squeeze(1), targets[start : start + chunk_size], 0)  # an ignored target gathers id 0
        logits = torch.matmul(h, weight.t()).to(compute)
        picked = logits.gather(1, t.unsqueeze(1))
        # loss = logsumexp(logits) − logits[target], with logsumexp = log Σ exp(logits − max) + max. The
        # exponentials are taken once, in place, and serve the gradient too: 5 passes over the chunk, not 7.
        row_max = logits.amax(dim=1, keepdim=True)
        exp = logits.sub_(row_max).exp_()
        sum_exp = exp.sum(dim=1, keepdim=True)
        total += ((sum_exp.log() + row_max - picked) * k).sum()
        if grad_hidden is not None or grad_weight is not None:
            # d(mean loss)/d(logits) = (softmax - one_hot(target)) / count, built in place; an ignored row's
            # normaliser is made infinite, so its gradient is 0 with no extra pass over the chunk.
            grad_logits = exp.div_(sum_exp.mul_(count).masked_fill_(~k, float("inf")))
            grad_logits[torch.arange(t.shape[0], device=t.device), t] -= k.squeeze(1) / count
            if autocast:
                # Out-of-place GEMMs, which autocast runs in its dtype; the head's gradient summed in float32.
                # d loss/d logits is cast once for both (autocast would cast it for each, the same way).
                low = grad_logits.to(torch.get_autocast_dtype(hidden.device.type))
                if grad_hidden is not None:
                    grad_hidden[start : start + chunk_size] = torch.mm(low, weight)
                if grad_weight is not None:
                    grad_weight += torch.mm(low.t(), h)
                continue
            # Written by the GEMMs themselves (out=, and addmm_'s beta=1 accumulate): no temporary and no
            # extra pass over a vocab x d_model gradient per chunk.
            if grad_hidden is not None:
                torch.matmul(grad_logits.to(weight.dtype), weight, out=grad_hidden[start : start + chunk_size])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h.to(compute))
    return total / count, grad_hidden, grad_weight


def default_chunk_size(device: torch.device | str, vocab_size: int) -> int:
    """Tokens per chunk of the head and loss when none is given: 256 on a CPU, where a chunk's logits are
    best kept within the caches; on an accelerator as many as give about 2^27 logits (512 MiB in float32,
    e.g. 2,048 tokens at a 50k vocabulary), a power of two from 1,024 to 8,192, so that each chunk's
    GEMMs are large enough to fill the device and the ~10 kernels per chunk are few."""
    if torch.device(device).type == "cpu":
        return 256
    fit = max(1, (1 << 27) // max(vocab_size, 1))
    return min(8192, max(1024, 1 << (fit.bit_length() - 1)))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):  # type: ignore[no-untyped-def]
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_hidden, grad_weight = _chunked_loss(hidden, weight, targets, chunk_size, want_hidden, want_weight)
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        return loss.to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[no-untyped-def]
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype),
            None if grad_weight is None else grad_weight * grad_loss.to(grad_weight.dtype),
            None,
            None,
        )


def chunked_cross_entropy(
    hidden: Float[Tensor, "tokens d_model"],
    weight: Float[Tensor, "vocab d_model"],
    targets: Integer[Tensor, " tokens"],
    chunk_size: int | None = None,
) -> Float[Tensor, ""]:
    """``F.cross_entropy(hidden @ weight.T, targets)`` (mean over tokens), a chunk of tokens at a time.

    With gradients enabled and an input that requires grad, the gradients are computed during this
    forward pass (and handed to autograd); otherwise (evaluation under ``torch.no_grad()``) only the
    loss is, with no gradient buffer built. The shapes are checked here; the values are not: a target
    outside ``[0, vocab)`` is refused by ``gather``'s kernel (``RuntimeError`` on the CPU, a device-side
    assert elsewhere), so no value is read back to the host. Targets equal to ``IGNORE_INDEX`` (-100) are
    skipped, as ``F.cross_entropy``'s ``ignore_index`` skips them: the mean is over the others (0 when
    every target is ignored, where torch gives NaN). ``chunk_size`` None: :func:`default_chunk_size` for the
    device and vocabulary.
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (tokens, d_model) and weight (vocab, d_model), got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.device, weight.shape[0])
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must have shape ({hidden.shape[0]},), got {tuple(targets.shape)}")
    targets = targets.long() if targets.dtype in _WIDEN else targets
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_size)
    # No gradient can be asked for (torch.no_grad(), inference_mode, or inputs that do not require
    # grad): the forward alone. autograd.Function would still report needs_input_grad from the
    # inputs' requires_grad and build both gradients, ~2x the work and a vocab x d_model buffer.
    loss, _, _ = _chunked_loss(hidden, weight, targets, chunk_size, want_hidden=False, want_weight=False)
    return loss.to(hidden.dtype)
