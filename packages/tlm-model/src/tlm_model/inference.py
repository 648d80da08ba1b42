"""A compiled, weight-frozen view of a TransformerLM for inference (prefill and KV-cached decoding), and
:func:`unwrap`, which finds the model inside it and the other wrappers."""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from tlm_attention import KVCache
from tlm_model.lm import TransformerLM, check_token_ids, continue_rows

#: What ``compile_for_inference`` passes to ``torch.compile``. max-autotune lets inductor pick its own C++ GEMM
#: kernels; with frozen weights they work on pre-packed (oneDNN) copies of the weights (docs/benchmarks.md).
COMPILE_KWARGS: dict[str, Any] = {"mode": "max-autotune-no-cudagraphs", "dynamic": True}

#: inductor's options for "max-autotune-no-cudagraphs" (``torch.compile`` takes a mode or options, not both).
_AUTOTUNE = {"max_autotune": True, "coordinate_descent_tuning": True}

#: What the decode step and prompt chunks add to their options: no guards on the model's modules (the wrapper's
#: weights are frozen constants of the graph already: a changed model needs a new ``compile_for_inference``),
#: which leaves dynamo fewer checks to run before every step.
#: Found by feature detection (a newer torch's function): without it the steps keep dynamo's module guards.
_SKIP_MODULE_GUARDS = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
_STEP_OPTIONS: dict[str, Any] = {} if _SKIP_MODULE_GUARDS is None else {"guard_filter_fn": _SKIP_MODULE_GUARDS}

#: What the fixed-shape decode step (:meth:`InferenceModel.decode_step`) is compiled with, by device type:
#: one graph per (batch bucket, capacity), whose dynamic sizes are the number of slots it reads and, on a CPU, the
#: batch above one row (see :meth:`InferenceModel.decode_step`); CUDA graphs on CUDA ("reduce-overhead"),
#: inductor's autotuned GEMMs on CPU (its C++ wrapper was tried and dropped: docs/benchmarks.md).
DECODE_COMPILE_KWARGS: dict[str, dict[str, Any]] = {
    "cuda": {"dynamic": False, "fullgraph": True, "options": {"triton.cudagraphs": True, **_STEP_OPTIONS}},
    "cpu": {"dynamic": False, "fullgraph": True, "options": {**_AUTOTUNE, **_STEP_OPTIONS}},
}

#: What prompt chunks (:meth:`InferenceModel.prefill_step`) are compiled with: the sizes that change (rows, chunk
#: width, picked logits, slots) are marked dynamic at the first call while the caches' buffers stay static.
PREFILL_COMPILE_KWARGS: dict[str, Any] = {"dynamic": None, "fullgraph": True, "options": {**_AUTOTUNE, **_STEP_OPTIONS}}


def _compile(fn: Any, kwargs: dict[str, Any]) -> Any:
    # torch.compile pops entries (guard_filter_fn) from the options it is given: each call gets its own copy.
    kwargs = dict(kwargs)
    if "options" in kwargs:
        kwargs["options"] = dict(kwargs["options"])
    return torch.compile(fn, **kwargs)


class InferenceModel(nn.Module):
    """Wraps a TransformerLM: calls run the compiled graph under ``torch.no_grad()`` with inductor's
    weight freezing on. ``config`` and ``new_kv_cache`` are the model's, so :func:`generate` takes it.

    Freezing treats the weights as constants of the compiled graph: changing them afterwards
    (training, ``load_state_dict``) does not reach this wrapper; build a new one. Nor does any other change
    to the model's modules (a new attention backend, say): the decode and prompt-chunk graphs are not guarded
    on them, which saves each step dynamo's checks of every module and parameter.
    """

    def __init__(self, model: TransformerLM) -> None:
        super().__init__()
        if not isinstance(model, TransformerLM):
            raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
        self.model = model.eval()
        self.compiled = torch.compile(model, **COMPILE_KWARGS)
        device = model.lm_head.weight.device.type
        decode_kwargs = DECODE_COMPILE_KWARGS.get(device, DECODE_COMPILE_KWARGS["cpu"])

        # Two functions (two code objects), so the fixed-shape decode graphs and the dynamic-shape prefill
        # graphs are cached apart.
        def decode(tokens: Tensor, positions: Tensor, cache: KVCache, slots: Tensor | None) -> Tensor:
            return model.forward_static(tokens, positions, cache, slots=slots)

        def prefill(
            tokens: Tensor, positions: Tensor, cache: KVCache, rows: Tensor | None, last: Tensor, slots: Tensor | None
        ) -> Tensor:
            return model.forward_static(tokens, positions, cache, rows, last, slots)

        self._decode = _compile(decode, decode_kwargs)
        self._prefill = _compile(prefill, PREFILL_COMPILE_KWARGS)

    @property
    def config(self):  # type: ignore[no-untyped-def]
        return self.model.config

    def new_kv_cache(self, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        return self.model.new_kv_cache(*args, **kwargs)

    def forward(
        self, in_indices: Tensor, token_positions: Tensor | None = None, kv_cache: KVCache | None = None
    ) -> Tensor:
        """The model's forward, compiled; with ``kv_cache`` the tokens continue its rows through the prompt-chunk
        graph (:func:`~tlm_model.lm.continue_rows`). The ids are checked here, as the eager model's embedding
        checks them: one read of their range, outside the graph (the decoding loops' steps skip it)."""
        check_token_ids(in_indices, self.model.config.vocab_size)
        if kv_cache is not None:
            return continue_rows(self.prefill_step, in_indices, kv_cache, token_positions)
        with _frozen():
            return self.compiled(in_indices, token_positions)

    def decode_step(self, tokens: Tensor, positions: Tensor, cache: KVCache, slots: Tensor | None = None) -> Tensor:
        """:meth:`TransformerLM.forward_static` (batch, 1) compiled at a fixed shape (on CUDA one graph per
        batch size and capacity, CUDA graphs). Unchecked: the caller feeds sampled ids and the caches' positions.

        On a CPU the batch size is a dynamic size too (above 1: dynamo specialises a size of 1), so there are
        two graphs per capacity, batch 1 and every other bucket. That is for speed as much as for fewer
        compilations: inductor packs a frozen float32 weight for MKL's GEMM when the batch is a constant and
        for oneDNN's, faster on AMD CPUs (docs/benchmarks.md), when it is symbolic.

        ``slots`` (``arange(n)``: read only the first ``n`` slots of each cache) has its length marked dynamic,
        so every ``n`` runs the same graph; CUDA graphs record one graph per distinct ``n`` (hence powers of
        two, :func:`~tlm_model.batching.slot_bucket`)."""
        _dynamic_slots(slots)
        with _frozen():
            if tokens.device.type != "cuda":
                if tokens.shape[0] > 1:  # one graph for every batch bucket above 1, on oneDNN's GEMMs
                    # "maybe": with room for 2 rows, 2 is the only such bucket and dynamo makes it a constant.
                    torch._dynamo.maybe_mark_dynamic(tokens, 0)
                    torch._dynamo.maybe_mark_dynamic(positions, 0)
                return self._decode(tokens, positions, cache, slots)
            # CUDA graphs: the caches' buffers are static inputs (written in place by the graph, never copied),
            # each call is a new step, and the logits are copied out of the graph's memory, which the next
            # replay reuses.
            for buffer in (*cache.key_buffers, *cache.value_buffers):
                torch._dynamo.mark_static_address(buffer)
            torch.compiler.cudagraph_mark_step_begin()
            return self._decode(tokens, positions, cache, slots).clone()

    def prefill_step(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache,
        rows: Tensor | None,
        last: Tensor,
        slots: Tensor | None = None,
    ) -> Tensor:
        """:meth:`TransformerLM.forward_static` for prompt chunks: one graph for every chunk. The chunk's rows,
        width and picked logits (``last``) are dynamic sizes from the first call, as is ``slots``' length (see
        :meth:`decode_step`), on every device; the caller keeps each of them at 2 or more
        (:func:`~tlm_model.batching.pack_chunks`), since dynamo specialises a size of 1 whatever it is told.
        On a CPU the first graph then already runs on oneDNN's GEMMs (see :meth:`decode_step`)."""
        _dynamic_slots(slots)
        for tensor in (tokens, positions):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        for picked in (rows, last):
            if picked is not None:
                torch._dynamo.maybe_mark_dynamic(picked, 0)
        with _frozen():
            return self._prefill(tokens, positions, cache, rows, last, slots)


def _dynamic_slots(slots: Tensor | None) -> None:
    # A size of 1 (a cache of capacity 1) would be specialised by dynamo whatever it is told: left static.
    if slots is not None and slots.shape[0] > 1:
        torch._dynamo.mark_dynamic(slots, 0)


@contextlib.contextmanager
def _frozen() -> Iterator[None]:
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as shape_config

    # Freezing is read when dynamo traces and inductor compiles, which may be any call (a new shape
    # recompiles), so it is switched on around every call rather than once: set and reset directly (a
    # ``config.patch`` object costs a decode step tens of microseconds). Duck shaping off too: sizes that
    # happen to be equal when a graph is traced (a chunk's rows and width, say) would otherwise share one
    # symbol, and the graph would recompile the first time they differ.
    saved = inductor_config.freezing, shape_config.use_duck_shape
    inductor_config.freezing, shape_config.use_duck_shape = True, False
    try:
        with torch.no_grad():
            yield
    finally:
        inductor_config.freezing, shape_config.use_duck_shape = saved


def compile_for_inference(model: TransformerLM) -> InferenceModel:
    """``torch.compile`` ``model`` for inference with frozen weights and autotuned CPU GEMMs.

    The first calls compile (minutes on a small CPU); afterwards decoding runs faster than eager, how much
    depending on the CPU's oneDNN GEMM (docs/benchmarks.md). Outputs match the eager model to float32 rounding.

    What it checks: a plain call refuses what the eager model refuses (ids outside the vocabulary, explicit
    positions with a KV cache, a cache too full) before the graph runs. :meth:`InferenceModel.decode_step` and
    :meth:`InferenceModel.prefill_step`, what :func:`generate` and :class:`~tlm_model.batching.DecodeBatch`
    run, check nothing: their callers check the prompts once where they enter and feed sampled ids after.
    """
    return InferenceModel(model)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside the wrappers tlm and torch put around a model: ``torch.compile``'s
    (``_orig_mod``), :func:`~tlm_model.compile_for_inference`'s and DDP's (``module``)."""
    for _ in range(8):  # wrappers nest at most a few deep; a cycle must not hang
        if isinstance(model, TransformerLM):
            break
        if isinstance(model, InferenceModel):
            model = model.model
            continue
        inner = getattr(model, "_orig_mod", None)
        inner = getattr(model, "module", None) if inner is None else inner
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model
