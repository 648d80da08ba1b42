"""The one weight of a Linear or an Embedding, and the course's rule that draws it."""

import torch
from torch import nn

from tlm_core.checks import check_number


class TruncatedNormalWeight(nn.Module):
    """A module whose parameter ``weight`` is drawn from N(0, init_std²) truncated at ±3·init_std
    (CS336 §1.4.1), at construction and by :meth:`reset_parameters`."""

    weight: nn.Parameter
    init_std: float

    def _make_weight(
        self, shape: tuple[int, int], init_std: float, device: torch.device | str | None, dtype: torch.dtype | None
    ) -> None:
        self.init_std = check_number("init_std", init_std, low=0.0, low_open=True)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.init_std
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3.0 * std, b=3.0 * std)
