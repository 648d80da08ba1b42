"""RoPE: rotate each pair (x[2k], x[2k+1]) at position i by θ_{i,k} = i · Θ^(-2k/d)."""

from collections.abc import Mapping
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Float, Integer
from torch import Tensor, nn

from tlm_core.checks import check_choice, check_number, check_positive_int
from tlm_core.tensors import check_float_tensor
from tlm_rope.options import LAYOUTS, check_scaling
from tlm_rope.scaling import inv_freq_and_factor

#: Integer dtypes that index_select does not take directly, widened to int64.
_WIDEN = frozenset({torch.uint8, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64})

#: Devices whose kernels multiply complex tensors (elsewhere the interleaved layout uses the real form).
_COMPLEX = ("cpu", "cuda")


class RotaryPositionalEmbedding(nn.Module):
    """Applies the block-diagonal rotation R^i of CS336 §1.5.3 to the last dimension.

    ``layout="interleaved"`` (the default) pairs (x[0], x[1]), (x[2], x[3]), ... as in the
    original paper and Meta's LLaMA code; ``layout="half"`` pairs (x[k], x[k + d/2]) as HF
    transformers and GPT-NeoX do ("rotate-half"). The two agree only after permuting the q/k
    projection rows.

    ``seq_dim`` says which axis of the input is the sequence: -2 for (..., seq, d_k) (the default,
    e.g. (batch, heads, seq, d_k)), -3 for (..., seq, heads, d_k) (torchtune's and flash-attn's
    layout); no other axis is accepted. ``rotary_dim`` (default ``d_k``, even) rotates only the
    first ``rotary_dim`` features and passes the rest through (GPT-NeoX, Phi). ``scaling`` extends
    the context with HF's ``rope_parameters`` keys: ``{"rope_type": "linear", "factor": f}``,
    ``"dynamic"`` (+ ``original_max_position_embeddings``), ``"yarn"`` (+ the same, and optional
    ``beta_fast``, ``beta_slow``, ``attention_factor``, ``mscale``, ``mscale_all_dim``, ``truncate``)
    or ``"llama3"`` (+ ``low_freq_factor``, ``high_freq_factor``); see :mod:`tlm_rope.scaling`.

    Past ``max_seq_len`` nothing is extrapolated silently: a position >= ``max_seq_len`` is a
    ``ValueError`` that names the limit (build the module with a larger ``max_seq_len``; the
    tables cost 8·max_seq_len·rotary_dim/2 bytes). ``dynamic`` scaling recomputes its frequencies for
    each call whose sequence reaches past ``original_max_position_embeddings`` (as HF does, for the
    whole call); that reads the largest position, a host sync when ``token_positions`` are given.

    cos/sin tables of shape (max_seq_len, d_k/2) are built once, angles computed in float64
    and stored in float32, as non-persistent buffers (they never enter a state dict); they are
    views of one (max_seq_len, d_k/2, 2) table of (cos, sin) pairs, which the interleaved layout
    reads as complex numbers. They stay float32 under ``module.to(torch.bfloat16)``: bfloat16 has 8
    mantissa bits and cannot tell position 300 from 301. The module has no learnable parameters.
    """

    cos: Tensor
    sin: Tensor
    _pairs: Tensor

    def __init__(
        self,
        theta: float,
        d_k: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
        *,
        layout: str = "interleaved",
        seq_dim: int = -2,
        rotary_dim: int | None = None,
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        check_number("theta", theta, low=0.0, low_open=True)
        check_positive_int("d_k", d_k)
        check_positive_int("max_seq_len", max_seq_len)
        if d_k % 2 != 0:
            raise ValueError(f"d_k must be even (RoPE rotates pairs of dimensions), got {d_k}")
        check_choice("layout", layout, LAYOUTS)
        if isinstance(seq_dim, bool) or seq_dim not in (-2, -3):
            raise ValueError(
                f"seq_dim must be -2 (input (..., seq, d_k)) or -3 (input (..., seq, heads, d_k)), got {seq_dim!r}"
            )
        rotary_dim = d_k if rotary_dim is None else check_positive_int("rotary_dim", rotary_dim)
        if rotary_dim % 2 != 0 or rotary_dim > d_k:
            raise ValueError(f"rotary_dim must be even and at most d_k={d_k}, got {rotary_dim}")
        self.theta = float(theta)
        self.d_k = d_k
        self.max_seq_len = max_seq_len
        self.layout = layout
        self.seq_dim = seq_dim
        self.rotary_dim = rotary_dim
        self.scaling = check_scaling(scaling)
        pairs = self._pair_table(torch.device(device) if device is not None else None)
        self.register_buffer("cos", pairs[..., 0], persistent=False)
        self.register_buffer("sin", pairs[..., 1], persistent=False)
        # The interleaved layout multiplies by this table read as complex numbers (cos + i·sin); as
        # the buffers are views of it, autograd saves one table, shared by every layer and call.
        self._pairs = pairs

    def _pair_table(self, device: torch.device | None) -> Tensor:
        """(max_seq_len, rotary_dim // 2, 2): cos and sin side by side."""
        if device is not None and device.type == "meta":  # shapes only; torch.stack on meta imports torch._dynamo
            return torch.empty(self.max_seq_len, self.rotary_dim // 2, 2, dtype=torch.float32, device=device)
        return torch.stack(self._tables(device), dim=-1)

    def _tables(self, device: torch.device | None, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
        # float64 on the CPU first: a float32 Θ^(-2k/d) carries ~1e-7 relative error, which
        # position 16384 would turn into ~2e-3 rad of rotation error.
        if device is not None and device.type == "meta":
            shape = (self.max_seq_len, self.rotary_dim // 2)
            return (torch.empty(shape, device=device), torch.empty(shape, device=device))
        inv_freq, factor = inv_freq_and_factor(self.theta, self.rotary_dim, self.scaling, seq_len)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64), inv_freq)
        return (
            (angles.cos() * factor).to(device=device, dtype=torch.float32),
            (angles.sin() * factor).to(device=device, dtype=torch.float32),
        )

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        # The tables are a pure function of (theta, d_k, max_seq_len), so rebuild them on the
        # new device rather than trust what fn did: .to(bfloat16) would have rounded the angles,
        # and to_empty() leaves them uninitialised (also when a shared module is visited twice).
        self._pairs = self._pair_table(self.cos.device)
        self.cos, self.sin = self._pairs[..., 0], self._pairs[..., 1]
        return self

    def forward(
        self,
        # Where seq sits depends on seq_dim (-2 or -3), so the shapes name only d_k; the body checks the rest.
        x: Float[Tensor, "... d_k"],
        token_positions: Integer[Tensor, "..."] | None = None,
        *,
        start: int = 0,
    ) -> Float[Tensor, "... d_k"]:
        """Rotate ``x`` of shape (..., seq, d_k) (``seq_dim=-2``) or (..., seq, heads, d_k)
        (``seq_dim=-3``); ``token_positions`` (default ``start``..``start``+seq-1) broadcast against
        (..., seq). ``start`` (a KV cache's length) reads the tables by slice, with no index tensor to check."""
        check_float_tensor("x", x)
        axes = "(..., seq, d_k" if self.seq_dim == -2 else "(..., seq, heads, d_k"
        if x.ndim < -self.seq_dim or x.shape[-1] != self.d_k:
            raise ValueError(f"x must have shape {axes}={self.d_k}), got {tuple(x.shape)}")
        if isinstance(start, bool) or not isinstance(start, (int, torch.SymInt)) or start < 0:
            raise ValueError(f"start must be an int >= 0, got {start!r}")
        if token_positions is not None and start != 0:
            raise ValueError(f"give token_positions or start, not both (start={start})")
        seq = x.shape[self.seq_dim]
        lead = x.shape[:-1] if self.seq_dim == -2 else x.shape[:-2]
        # The interleaved layout rotates by one complex product, except under torch.compile (inductor
        # fuses the real form into one kernel, but generates no code for complex tensors).
        use_complex = self.layout == "interleaved" and not torch.compiler.is_compiling() and x.device.type in _COMPLEX
        tables: tuple[Tensor, ...] = (self._pairs,) if use_complex else (self.cos, self.sin)
        if token_positions is None:
            end = start + seq
            if end > self.max_seq_len:
                raise ValueError(
                    f"x has seq={seq} positions"
                    + (f" from start={start}" if start else "")
                    + f" but the tables hold max_seq_len={self.max_seq_len}; "
                    "pass token_positions or build the module with a larger max_seq_len"
                )
            if self._dynamic_past_original(end):
                tables = self._dynamic_tables(end, use_complex)
            tables = tuple(t[start:end] for t in tables)
        else:
            token_positions = self._check_positions(token_positions, lead)
            if self._is_dynamic() and token_positions.numel():
                length = int(token_positions.max()) + 1  # a host sync, only for dynamic scaling
                if self._dynamic_past_original(length):
                    tables = self._dynamic_tables(length, use_complex)
            # index_select, not indexing: its kernel refuses a position outside the tables (IndexError on
            # the CPU, a device-side assert elsewhere) where indexing would wrap a negative one, and no
            # value is read back to the host.
            flat = token_positions.reshape(-1)
            tables = tuple(t.index_select(0, flat).view(*token_positions.shape, *t.shape[1:]) for t in tables)
        if self.seq_dim == -3:  # one rotation for every head at a position
            tables = tuple(t.unsqueeze(-3 if use_complex else -2) for t in tables)

        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        x32 = x.to(compute_dtype)
        rot = x32 if self.rotary_dim == self.d_k else x32[..., : self.rotary_dim]
        if use_complex:
            rot = _rotate_complex(rot, tables[0])
        else:
            cos, sin = (t.to(compute_dtype) for t in tables)
            if self.layout == "interleaved":
                pairs = rearrange(rot, "... (half two) -> ... half two", two=2)
                even, odd = pairs.unbind(-1)
                rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
                rot = rearrange(rotated, "... half two -> ... (half two)")
            else:
                # (first·cos − second·sin, second·cos + first·sin) as (first, second)·cos + (−second, first)·sin
                # over a (2, d/2) view: the same products, with x's memory order kept (see _rotate_complex).
                halves = rot.unflatten(-1, (2, -1))
                first, second = halves.unbind(-2)
                rotated_half = torch.stack((-second, first), dim=-2)
                rot = (halves * cos.unsqueeze(-2) + rotated_half * sin.unsqueeze(-2)).flatten(-2)
        if self.rotary_dim < self.d_k:  # the features past rotary_dim pass through
            rot = torch.cat((rot, x32[..., self.rotary_dim :]), dim=-1)
        return rot.to(x.dtype)

    def _dynamic_tables(self, seq_len: int, pairs: bool) -> tuple[Tensor, ...]:
        cos, sin = self._tables(self.cos.device, seq_len)
        return (torch.stack((cos, sin), dim=-1),) if pairs else (cos, sin)

    def _is_dynamic(self) -> bool:
        return self.scaling is not None and self.scaling["rope_type"] == "dynamic"

    def _dynamic_past_original(self, seq_len: int) -> bool:
        return self._is_dynamic() and seq_len > self.scaling["original_max_position_embeddings"]  # type: ignore[index]

    def _check_positions(self, token_positions: Tensor, lead_shape: torch.Size) -> Tensor:
        if not isinstance(token_positions, Tensor):
            raise TypeError(f"token_positions must be a torch.Tensor, got {type(token_positions).__name__}")
        if not _broadcasts_to(token_positions.shape, lead_shape):
            raise ValueError(
                f"token_positions of shape {tuple(token_positions.shape)} must broadcast to "
                f"x.shape[:{self.seq_dim + 1}] = {tuple(lead_shape)} (that is, (..., seq))"
            )
        if token_positions.dtype in _WIDEN:  # uint8 would be read as a mask; index_select takes int32/int64
            return token_positions.long()
        return token_positions

    def extra_repr(self) -> str:
        extra = "" if self.rotary_dim == self.d_k else f", rotary_dim={self.rotary_dim}"
        extra += "" if self.scaling is None else f", scaling={self.scaling}"
        return (
            f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}, layout={self.layout!r}, "
            f"seq_dim={self.seq_dim}{extra}"
        )


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target`` (``torch.broadcast_shapes(shape, target) == target``),
    in plain Python: ``torch.broadcast_shapes`` imports sympy on its first call (seconds, on a server's first
    request) and costs a dispatch on every one."""
    if len(shape) > len(target):
        return False
    return all(a == 1 or a == b for a, b in zip(reversed(shape), reversed(target), strict=False))


def _rotate_complex(x: Tensor, pairs: Tensor) -> Tensor:
    """The interleaved rotation as one complex product, (x[2k] + i·x[2k+1]) · (cos_k + i·sin_k).

    Its parts are x[2k]·cos − x[2k+1]·sin and x[2k]·sin + x[2k+1]·cos, the real form's arithmetic,
    in one vectorised pass instead of six strided ones. The product
    keeps x's memory order, so q and k cut from one projection stay in (seq, heads) order and the
    attention output needs no copy before the output projection.
    """
    x_pairs = x.unflatten(-1, (-1, 2))
    if x_pairs.stride(-1) != 1 or x_pairs.storage_offset() % 2 or any(s % 2 for s in x_pairs.stride()[:-1]):
        x_pairs = x_pairs.contiguous()  # view_as_complex needs (re, im) adjacent at even offsets
    factor = torch.view_as_complex(pairs if pairs.dtype == x.dtype else pairs.to(x.dtype))
    return torch.view_as_real(torch.view_as_complex(x_pairs) * factor).flatten(-2)
