"""A bias-free linear layer, y = x Wᵀ, that does not use nn.Linear or F.linear."""

import contextlib
import math
import threading
from collections.abc import Iterator

import torch
from jaxtyping import Float
from torch import Tensor, nn

from tlm_core.checks import check_positive_int
from tlm_linear._weight import TruncatedNormalWeight


class Linear(TruncatedNormalWeight):
    """Applies ``y = x @ weight.T`` over the last dimension of ``x``.

    ``weight`` is stored as (out_features, in_features), the same layout as ``nn.Linear``,
    so checkpoints move between the two unchanged. There is no bias, as in LLaMA and PaLM.

    Initialisation (CS336 §1.4.1): N(0, σ²) with σ² = 2 / (in_features + out_features),
    truncated at ±3σ; ``init_std`` overrides σ.

    ``forward`` checks nothing itself: the annotation states the shapes (and the tests' shape checker
    enforces it), and ``torch.matmul`` refuses a last dimension or a dtype that does not match.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        init_std: float | None = None,
    ) -> None:
        super().__init__()
        self.in_features = check_positive_int("in_features", in_features)
        self.out_features = check_positive_int("out_features", out_features)
        # A layer that stacks several projections (fused q/k/v) passes the std of one of them.
        std = math.sqrt(2.0 / (in_features + out_features)) if init_std is None else init_std
        self._make_weight((out_features, in_features), std, device, dtype)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        if not torch.compiler.is_compiling():  # (a compiled graph packs its own weights: inductor's freezing)
            packs = getattr(_active, "packs", None)
            if packs is not None and (out := packs.apply(self, x)) is not None:
                return out
        # matmul folds every leading dimension into one GEMM against the (in, out) view of weight.
        return torch.matmul(x, self.weight.t())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


#: MKL's GEMM on a weight packed once (what inductor's frozen CPU graphs call), where this torch has it.
_MKL_LINEAR = getattr(torch.ops.mkl, "_mkl_linear", None) if torch.backends.mkl.is_available() else None

#: The PackedWeights a thread's Linear layers use (PackedWeights.active), per thread: a compiling thread beside
#: an eager one never sees them.
_active = threading.local()


class PackedWeights:
    """MKL-packed copies of the float32 CPU weights of every :class:`Linear` in ``module``, for GEMMs of exactly
    ``rows`` rows (the leading dimensions folded): inside :meth:`active`, such a layer's forward runs MKL's GEMM
    on its packed copy instead of ``torch.matmul``, which packs the weight again at every call. An eager decode
    step at a fixed batch size gains most (docs/benchmarks.md). Results equal ``torch.matmul``'s up to float32
    rounding (the GEMM may sum in another order).

    A layer is skipped (plain matmul) when its input has another number of rows or dtype, when gradients are
    on, and once its weight changed after packing (another tensor, or written in place): the copies never
    serve stale weights. Without MKL (another platform's torch) nothing is packed. The copies cost one more
    copy of the weights' memory while this object lives."""

    def __init__(self, module: nn.Module, rows: int) -> None:
        self.rows = check_positive_int("rows", rows)
        self._packs: dict[nn.Module, tuple[Tensor, int, Tensor]] = {}
        if _MKL_LINEAR is None:
            return
        for layer in module.modules():
            weight = getattr(layer, "weight", None)
            # An inference tensor keeps no version counter (a write to it could not be seen): left unpacked.
            if (
                isinstance(layer, Linear)
                and weight is not None
                and weight.device.type == "cpu"
                and (weight.dtype == torch.float32 and not weight.is_inference())
            ):
                with torch.no_grad():
                    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
                self._packs[layer] = (weight, weight._version, packed)

    def __len__(self) -> int:
        """How many layers have a packed copy."""
        return len(self._packs)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The Linear layers called from this thread use the packed copies until the block ends."""
        saved = getattr(_active, "packs", None)
        _active.packs = self
        try:
            yield
        finally:
            _active.packs = saved

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor | None:
        """``layer``'s output on its packed copy, or None where the plain matmul must run (see the class doc)."""
        entry = self._packs.get(layer)
        if entry is None or _MKL_LINEAR is None or x.dtype != torch.float32 or torch.is_grad_enabled():
            return None  # (no entry without MKL: the check is for the type checker)
        weight, version, packed = entry
        if layer.weight is not weight or weight._version != version or x.numel() != self.rows * x.shape[-1]:
            return None
        return _MKL_LINEAR(x, packed, weight, None, self.rows)
