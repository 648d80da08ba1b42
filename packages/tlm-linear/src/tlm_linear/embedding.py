"""A token-embedding lookup table that does not use nn.Embedding or F.embedding."""

import torch
from jaxtyping import Float, Integer
from torch import Tensor, nn

from tlm_core.checks import check_number, check_positive_int
from tlm_core.tensors import as_index_tensor


class Embedding(nn.Module):
    """Maps integer token ids of any shape to rows of ``weight`` (num_embeddings, embedding_dim).

    Initialisation (CS336 §1.4.1): N(0, 1) truncated at ±3; ``init_std`` sets σ (truncated at ±3σ), for
    a table that is also an LM head (tied weights), whose logits need a smaller scale.

    Ids may have any integer dtype (uint8 ... int64) and are checked against
    ``[0, num_embeddings)``: a negative id would otherwise silently wrap around to the end of the
    table. CPU ids are checked eagerly (``ValueError``); on an accelerator and inside
    ``torch.compile`` a device-side assert (``torch._assert_async``) refuses them without a host sync.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        init_std: float = 1.0,
    ) -> None:
        super().__init__()
        self.num_embeddings = check_positive_int("num_embeddings", num_embeddings)
        self.embedding_dim = check_positive_int("embedding_dim", embedding_dim)
        self.init_std = check_number("init_std", init_std, low=0.0, low_open=True)
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.init_std
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3.0 * std, b=3.0 * std)

    def forward(self, token_ids: Integer[Tensor, "..."]) -> Float[Tensor, "... d_model"]:
        token_ids = as_index_tensor("token_ids", token_ids, self.num_embeddings, "num_embeddings")
        return self.weight[token_ids]

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"
