"""A token-embedding lookup table that does not use nn.Embedding or F.embedding."""

import torch
from jaxtyping import Float, Integer
from torch import Tensor, nn

from tlm_linear.linear import _check_dim


class Embedding(nn.Module):
    """Maps integer token ids of any shape to rows of ``weight`` (num_embeddings, embedding_dim).

    Initialisation (CS336 §1.4.1): N(0, 1) truncated at ±3.

    Ids are checked against ``[0, num_embeddings)`` on every eager call: a negative id would
    otherwise silently wrap around to the end of the table. The check is skipped while
    ``torch.compile`` traces the module, so compiled graphs have no data-dependent branch.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = _check_dim("num_embeddings", num_embeddings)
        self.embedding_dim = _check_dim("embedding_dim", embedding_dim)
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: Integer[Tensor, "..."]) -> Float[Tensor, "... d_model"]:
        if not isinstance(token_ids, Tensor):
            raise TypeError(f"token_ids must be a torch.Tensor, got {type(token_ids).__name__}")
        if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids must be an integer tensor, got dtype {token_ids.dtype}")
        if not torch.compiler.is_compiling() and token_ids.numel() > 0:
            low, high = int(token_ids.min()), int(token_ids.max())
            if low < 0 or high >= self.num_embeddings:
                raise ValueError(
                    f"token_ids must lie in [0, num_embeddings={self.num_embeddings}), got values in [{low}, {high}]"
                )
        if token_ids.dtype not in (torch.int32, torch.int64):
            # Advanced indexing reads uint8 (and bool) tensors as masks, not as ids.
            token_ids = token_ids.long()
        return self.weight[token_ids]

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"
