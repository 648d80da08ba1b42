"""RoPE: rotate each pair (x[2k], x[2k+1]) at position i by θ_{i,k} = i · Θ^(-2k/d)."""

import torch
from einops import rearrange
from jaxtyping import Float, Integer
from torch import Tensor, nn

from tlm_rope._checks import as_index_tensor, check_positive_float, check_positive_int


class RotaryPositionalEmbedding(nn.Module):
    """Applies the block-diagonal rotation R^i of CS336 §1.5.3 to the last dimension.

    Pairs are *interleaved*: (x[0], x[1]), (x[2], x[3]), ... as in the original paper and
    Meta's LLaMA code. HF transformers and GPT-NeoX rotate (x[k], x[k + d/2]) instead
    ("rotate-half"); the two agree only after permuting the q/k projection rows.

    cos/sin tables of shape (max_seq_len, d_k/2) are built once, angles computed in float64
    and stored in float32, as non-persistent buffers (they never enter a state dict). They
    stay float32 under ``module.to(torch.bfloat16)``: bfloat16 has 8 mantissa bits and cannot
    tell position 300 from 301. The module has no learnable parameters.
    """

    cos: Tensor
    sin: Tensor

    def __init__(
        self,
        theta: float,
        d_k: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_positive_float("theta", theta)
        check_positive_int("d_k", d_k)
        check_positive_int("max_seq_len", max_seq_len)
        if d_k % 2 != 0:
            raise ValueError(f"d_k must be even (RoPE rotates pairs of dimensions), got {d_k}")
        self.theta = float(theta)
        self.d_k = d_k
        self.max_seq_len = max_seq_len
        cos, sin = self._tables(torch.device(device) if device is not None else None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device | None) -> tuple[Tensor, Tensor]:
        # float64 on the CPU first: a float32 Θ^(-2k/d) carries ~1e-7 relative error, which
        # position 16384 would turn into ~2e-3 rad of rotation error.
        if device is not None and device.type == "meta":
            shape = (self.max_seq_len, self.d_k // 2)
            return (torch.empty(shape, device=device), torch.empty(shape, device=device))
        inv_freq = self.theta ** (-torch.arange(0, self.d_k, 2, dtype=torch.float64) / self.d_k)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64), inv_freq)
        return (
            angles.cos().to(device=device, dtype=torch.float32),
            angles.sin().to(device=device, dtype=torch.float32),
        )

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        # The tables are a pure function of (theta, d_k, max_seq_len), so rebuild them on the
        # new device rather than trust what fn did: .to(bfloat16) would have rounded the angles,
        # and to_empty() leaves them uninitialised (also when a shared module is visited twice).
        self.cos, self.sin = self._tables(self.cos.device)
        return self

    def forward(
        self,
        x: Float[Tensor, "... seq d_k"],
        token_positions: Integer[Tensor, "... seq"] | None = None,
    ) -> Float[Tensor, "... seq d_k"]:
        """Rotate ``x``; ``token_positions`` (default 0..seq-1) broadcast against ``x.shape[:-1]``."""
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        if x.ndim < 2 or x.shape[-1] != self.d_k:
            raise ValueError(f"x must have shape (..., seq, d_k={self.d_k}), got {tuple(x.shape)}")
        seq = x.shape[-2]
        if token_positions is None:
            if seq > self.max_seq_len:
                raise ValueError(
                    f"x has seq={seq} positions but the tables hold max_seq_len={self.max_seq_len}; "
                    f"pass token_positions or build the module with a larger max_seq_len"
                )
            cos, sin = self.cos[:seq], self.sin[:seq]
        else:
            token_positions = self._check_positions(token_positions, x.shape[:-1])
            cos, sin = self.cos[token_positions], self.sin[token_positions]

        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        cos, sin = cos.to(compute_dtype), sin.to(compute_dtype)
        pairs = rearrange(x.to(compute_dtype), "... (half two) -> ... half two", two=2)
        even, odd = pairs.unbind(-1)
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rearrange(rotated, "... half two -> ... (half two)").to(x.dtype)

    def _check_positions(self, token_positions: Tensor, lead_shape: torch.Size) -> Tensor:
        if not isinstance(token_positions, Tensor):
            raise TypeError(f"token_positions must be a torch.Tensor, got {type(token_positions).__name__}")
        try:
            broadcast = torch.broadcast_shapes(token_positions.shape, lead_shape)
        except RuntimeError:
            broadcast = None
        if broadcast != lead_shape:
            raise ValueError(
                f"token_positions of shape {tuple(token_positions.shape)} must broadcast to x.shape[:-1] = "
                f"{tuple(lead_shape)} (that is, (..., seq))"
            )
        return as_index_tensor("token_positions", token_positions, self.max_seq_len, "max_seq_len")

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}"
