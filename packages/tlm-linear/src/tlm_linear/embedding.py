"""A token-embedding lookup table that does not use nn.Embedding or F.embedding."""

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from tlm_core.checks import check_positive_int
from tlm_linear._weight import TruncatedNormalWeight

#: Integer dtypes that index_select does not take directly, widened to int64 (never read as a mask).
_WIDEN = frozenset({torch.uint8, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64})


class Embedding(TruncatedNormalWeight):
    """Maps integer token ids of any shape to rows of ``weight`` (num_embeddings, embedding_dim).

    Initialisation (CS336 §1.4.1): N(0, 1) truncated at ±3; ``init_std`` sets σ (truncated at ±3σ), for
    a table that is also an LM head (tied weights), whose logits need a smaller scale.

    Ids may have any integer dtype (uint8 ... int64). The lookup is ``index_select``, whose kernel
    refuses an id outside ``[0, num_embeddings)`` (``IndexError`` on the CPU, a device-side assert on
    an accelerator) where indexing would wrap a negative id to the end of the table; no value is read
    back to the host. A float or bool tensor is refused by ``index_select`` itself.
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
        self._make_weight((num_embeddings, embedding_dim), init_std, device, dtype)

    def forward(self, token_ids: Integer[Tensor, "..."]) -> Float[Tensor, "... d_model"]:
        ids = token_ids.long() if token_ids.dtype in _WIDEN else token_ids
        return self.weight.index_select(0, ids.reshape(-1)).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"
