"""A bias-free linear layer, y = x Wᵀ, that does not use nn.Linear or F.linear."""

import math

import torch
from jaxtyping import Float
from torch import Tensor

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
        # matmul folds every leading dimension into one GEMM against the (in, out) view of weight.
        return torch.matmul(x, self.weight.t())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"
