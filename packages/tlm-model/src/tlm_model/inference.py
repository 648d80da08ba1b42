"""A compiled, weight-frozen view of a TransformerLM for inference (prefill and KV-cached decoding), and
:func:`unwrap`, which finds the model inside it and the other wrappers."""

from typing import Any

import torch
from torch import nn

from tlm_model.lm import TransformerLM

#: What ``compile_for_inference`` passes to ``torch.compile``. max-autotune lets inductor pick its
#: own C++ GEMM kernels; with frozen weights they work on pre-packed (oneDNN) copies of the weights.
#: Batch-1 greedy decoding of the course model on a 2-core AVX2 EPYC (bench/compile_variants.py and an
#: earlier run of the same method, each variant in its own process against eager there): 1.80-1.85x
#: eager as here, 1.37-1.50x frozen but not pre-packed (MKL matmuls), 1.25-1.28x not frozen; on a CPU
#: where oneDNN's GEMM ran 2.8x MKL's, 3x (docs/benchmarks.md).
COMPILE_KWARGS: dict[str, Any] = {"mode": "max-autotune-no-cudagraphs", "dynamic": True}


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
        self.compiled = torch.compile(model, **COMPILE_KWARGS)

    @property
    def config(self):  # type: ignore[no-untyped-def]
        return self.model.config

    def new_kv_cache(self, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        return self.model.new_kv_cache(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        import torch._inductor.config as inductor_config

        # Freezing is read when inductor compiles, which may be any call (a new shape recompiles),
        # so it is switched on around every call rather than once.
        with torch.no_grad(), inductor_config.patch(freezing=True):
            return self.compiled(*args, **kwargs)


def compile_for_inference(model: TransformerLM) -> InferenceModel:
    """``torch.compile`` ``model`` for inference with frozen weights and autotuned CPU GEMMs.

    The first calls compile (tens of seconds on a small CPU); afterwards batch-1 decoding runs 1.6-3x
    and prefill 1.1-2x faster than eager, depending on how fast the CPU's oneDNN GEMM is (see
    docs/benchmarks.md). Outputs match the eager model to float32 rounding.
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
