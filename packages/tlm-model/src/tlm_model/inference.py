"""A compiled, weight-frozen view of a TransformerLM for inference (prefill and KV-cached decoding)."""

from typing import Any

import torch
from torch import nn

from tlm_model.lm import TransformerLM


def compile_kwargs() -> dict[str, Any]:
    """What ``compile_for_inference`` passes to ``torch.compile``: inductor's "max-autotune-no-cudagraphs"
    options plus weight freezing. max-autotune lets inductor pick its own C++ GEMM kernels; with frozen
    weights they work on pre-packed copies, which is what makes batch-1 decoding (matrix-vector products)
    several times faster on CPU than eager matmuls. Freezing goes in as a compile option, read whenever
    inductor compiles (a new shape recompiles), not as a config patch around every call, which cost
    0.1-0.3 ms per decoded token. A function, so that ``import tlm_model`` does not import inductor (~2 s).
    """
    import torch._inductor

    options = torch._inductor.list_mode_options("max-autotune-no-cudagraphs")
    return {"options": {**options, "freezing": True}, "dynamic": True}


class InferenceModel(nn.Module):
    """Wraps a TransformerLM: calls run the compiled graph under ``torch.no_grad()`` with inductor's
    weight freezing on. ``config`` and ``new_kv_cache`` are the model's, so :func:`generate` takes it.

    Freezing treats the weights as constants of the compiled graph: changing them afterwards
    (training, ``load_state_dict``) does not reach this wrapper; build a new one.
    """

    def __init__(self, model: TransformerLM) -> None:
        super().__init__()
        if not isinstance(model, TransformerLM):
            raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
        self.model = model.eval()
        self.compiled = torch.compile(model, **compile_kwargs())

    @property
    def config(self):  # type: ignore[no-untyped-def]
        return self.model.config

    def new_kv_cache(self, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        return self.model.new_kv_cache(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Inductor freezes weights only in graphs compiled without autograd.
        with torch.no_grad():
            return self.compiled(*args, **kwargs)


def compile_for_inference(model: TransformerLM) -> InferenceModel:
    """``torch.compile`` ``model`` for inference with frozen weights and autotuned CPU GEMMs.

    The first calls compile (tens of seconds on a small CPU); afterwards prefill is ~10% and
    batch-1 decoding several times faster than eager (see docs/benchmarks.md). Outputs match the
    eager model to float32 rounding.
    """
    return InferenceModel(model)
