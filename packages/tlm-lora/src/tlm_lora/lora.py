"""LoRA (Hu et al. 2021): a frozen ``tlm_linear.Linear`` plus a trainable low-rank update ``B·A·(alpha/r)``.

Shapes follow the course's (out, in) layout: ``A`` is (r, in_features), ``B`` is (rows, r) and starts at
zero, so a freshly wrapped layer computes exactly what its base did. A fused projection (q/k/v stacked in
one weight, SwiGLU's w1/w3) keeps its one base matmul: each adapted part owns the row block
``tlm_linear.split_layout`` records for it, and the adapters of one layer run as two small matmuls
against the stacked ``A``s and a ``B`` laid out over the fused rows.

Roles (``q``, ``k``, ``v``, ``o``, ``w1``, ``w2``, ``w3``, ``lm_head``) are found by the course's module
names (``q_proj``, ``k_proj``, ``v_proj``, ``output_proj``, ``w1``, ``w2``, ``w3``, ``lm_head``), fused or
not; nothing here imports the attention, FFN or model packages.
"""

import hashlib
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tlm_core.checks import check_number, check_positive_int
from tlm_linear import Linear, split_layout
from tlm_lora.roles import MODULE_OF_ROLE, ROLE_OF_MODULE, check_targets

#: The adapter name of a layer that is adapted whole (PEFT's name for its one adapter).
WHOLE = "default"


class LoRALinear(nn.Module):
    """``y = x Wᵀ + (alpha/r) · (dropout(x) Aᵀ) Bᵀ`` around the frozen weight ``W`` of ``base``.

    ``rows`` names the output row blocks that get an adapter of their own (``{"q_proj": (0, 64),
    "v_proj": (96, 128)}`` on a fused q/k/v); None adapts every row under the name ``"default"``.
    ``W`` is ``base``'s own Parameter, registered here as ``weight`` (requires_grad off), so the state-dict
    keys of the base, and a fused weight's split layout, are unchanged; the adapters add
    ``lora_A.<name>`` (r, in_features) and ``lora_B.<name>`` (rows, r). ``A`` is drawn as PEFT draws it
    (Kaiming-uniform, a = √5), ``B`` is zero. ``dropout`` acts on the adapter path only, one mask per
    layer (shared by the parts of a fused layer). :meth:`merge` adds the update into ``W`` for inference
    and :meth:`unmerge` takes it out again (equal up to float rounding).
    """

    weight: nn.Parameter

    def __init__(
        self,
        base: Linear,
        rank: int,
        alpha: float | None = None,
        dropout: float = 0.0,
        *,
        rows: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(base, Linear):
            raise TypeError(f"base must be a tlm_linear.Linear, got {type(base).__name__}")
        self.rank = check_positive_int("rank", rank)
        self.alpha = float(rank) if alpha is None else check_number("alpha", alpha, low=0.0, low_open=True)
        self.dropout = check_number("dropout", dropout, low=0.0, high=1.0, high_open=True)
        self.scaling = self.alpha / self.rank
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rows = _checked_rows(rows, self.out_features)
        base.weight.requires_grad_(False)
        self.weight = base.weight
        self.merged = False
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.ParameterDict(
            {name: nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=dtype)) for name in self.rows}
        )
        self.lora_B = nn.ParameterDict(
            {
                name: nn.Parameter(torch.zeros(stop - start, rank, device=device, dtype=dtype))
                for name, (start, stop) in self.rows.items()
            }
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw the adapters (A Kaiming-uniform, B zero); the base weight is left alone."""
        for name in self.rows:
            nn.init.kaiming_uniform_(self.lora_A[name], a=math.sqrt(5))
            nn.init.zeros_(self.lora_B[name])

    def _stacked(self) -> tuple[Tensor, Tensor]:
        """(A of every adapter stacked, (n·r, in)), (B laid over the output rows, (out, n·r))."""
        names = list(self.rows)
        if len(names) == 1 and self.rows[names[0]] == (0, self.out_features):
            return self.lora_A[names[0]], self.lora_B[names[0]]
        a = torch.cat([self.lora_A[n] for n in names]) if len(names) > 1 else self.lora_A[names[0]]
        b = a.new_zeros(self.out_features, len(names) * self.rank)
        for i, name in enumerate(names):
            start, stop = self.rows[name]
            b[start:stop, i * self.rank : (i + 1) * self.rank] = self.lora_B[name]
        return a, b

    def delta_weight(self) -> Tensor:
        """The update ``(alpha/r) · B A`` as an (out_features, in_features) matrix (zero outside the rows)."""
        a, b = self._stacked()
        return torch.matmul(b, a) * self.scaling

    def forward(self, x: Tensor) -> Tensor:
        y = torch.matmul(x, self.weight.t())
        if self.merged:
            return y
        a, b = self._stacked()
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return y + torch.matmul(torch.matmul(h, a.t()), b.t()) * self.scaling

    def loss_operands(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """``(hidden', weight')`` with ``hidden' @ weight'ᵀ`` equal to ``forward(hidden)``: the hidden states
        widened by the adapter's r columns and the weight by ``B``. A loss that takes the head's weight
        (tlm-model's chunked cross-entropy) trains the adapter through them without building the logits."""
        if self.merged:
            return hidden, self.weight
        a, b = self._stacked()
        h = F.dropout(hidden, self.dropout, self.training) if self.dropout else hidden
        low = torch.matmul(h, a.t()) * self.scaling
        return torch.cat([hidden, low.to(hidden.dtype)], dim=-1), torch.cat([self.weight, b.to(self.weight.dtype)], 1)

    @torch.no_grad()
    def merge(self) -> None:
        """Add the update into ``weight`` (computed in float32); forward then runs the base matmul only."""
        if not self.merged:
            self.weight.add_(self.delta_weight().float().to(self.weight.dtype))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the update out of ``weight`` again (the weight returns up to float rounding)."""
        if self.merged:
            self.weight.sub_(self.delta_weight().float().to(self.weight.dtype))
            self.merged = False

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha:g}, dropout={self.dropout:g}, adapters={list(self.rows)}, merged={self.merged}"
        )


def _checked_rows(rows: Mapping[str, tuple[int, int]] | None, out_features: int) -> dict[str, tuple[int, int]]:
    if rows is None:
        return {WHOLE: (0, out_features)}
    if not isinstance(rows, Mapping) or not rows:
        raise ValueError(f"rows must be a non-empty mapping of name -> (start, stop), got {rows!r}")
    checked: dict[str, tuple[int, int]] = {}
    for name, span in rows.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"rows: each name must be an identifier, got {name!r}")
        ok = isinstance(span, tuple) and len(span) == 2 and all(type(v) is int for v in span)
        if not ok or not 0 <= span[0] < span[1] <= out_features:
            raise ValueError(
                f"rows[{name!r}] must be (start, stop) with 0 <= start < stop <= {out_features}, got {span!r}"
            )
        checked[name] = span
    spans = sorted(checked.values())
    if any(prev[1] > nxt[0] for prev, nxt in itertools.pairwise(spans)):
        raise ValueError(f"rows must not overlap, got {dict(rows)}")
    return checked


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """Every :class:`LoRALinear` in ``model`` with its qualified name."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def apply_lora(
    model: nn.Module,
    targets: str | Sequence[str] = ("q", "v"),
    rank: int = 8,
    alpha: float | None = None,
    dropout: float = 0.0,
) -> list[str]:
    """Freeze every parameter of ``model`` and wrap the ``Linear`` of each target role in a :class:`LoRALinear`.

    ``targets`` are roles of :data:`ROLES` (``"q,v"`` or ``["q", "v"]``); ``alpha`` defaults to ``rank``
    (scaling 1, PEFT's default). Fused projections keep their one weight, with an adapter per adapted part.
    Returns the names of the adapted projections as an unfused model names them (``layers.0.attn.q_proj``).
    Refuses a model that already has adapters, a target no module plays, and an ``lm_head`` whose weight
    is tied to another module's (merging would change that module too).
    """
    roles = check_targets(targets)
    check_positive_int("rank", rank)
    if alpha is not None:
        check_number("alpha", alpha, low=0.0, low_open=True)
    check_number("dropout", dropout, low=0.0, high=1.0, high_open=True)
    if any(True for _ in lora_modules(model)):
        raise ValueError("model already has LoRA adapters; apply_lora wraps a model once")
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    for p in model.parameters():
        p.requires_grad_(False)
    adapted: list[str] = []
    found: set[str] = set()
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, Linear):
                continue
            prefix = f"{parent_name}.{child_name}" if parent_name else child_name
            layout = split_layout(parent, child_name)
            rows: dict[str, tuple[int, int]] | None
            if layout is not None:
                rows, start = {}, 0
                for part, size in layout.items():
                    if ROLE_OF_MODULE.get(part) in roles:
                        rows[part] = (start, start + size)
                    start += size
                names = [f"{parent_name}.{p}" if parent_name else p for p in rows]
            else:
                role = ROLE_OF_MODULE.get(child_name)
                rows = None if role in roles else {}
                names = [prefix]
            if rows == {}:
                continue
            if child_name == "lm_head" and len(owners.get(id(child.weight), [])) > 1:
                raise ValueError(
                    f"{prefix}.weight is tied to {[o for o in owners[id(child.weight)] if o != prefix + '.weight']}: "
                    "an adapter on lm_head would also change that module when merged; leave lm_head out of targets"
                )
            setattr(parent, child_name, LoRALinear(child, rank, alpha, dropout, rows=rows))
            found.update(ROLE_OF_MODULE[n.rsplit(".", 1)[-1]] for n in names)
            adapted.extend(names)
    if missing := [r for r in roles if r not in found]:
        raise ValueError(f"targets {missing} match no tlm_linear.Linear named {[MODULE_OF_ROLE[r] for r in missing]}")
    return adapted


def _canonical(path: str, name: str) -> str:
    """The unfused module name an adapter belongs to: the layer's own for a whole layer, else its part's."""
    if name == WHOLE:
        return path
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    return f"{parent}.{name}" if parent else name


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters only, keyed ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` by the unfused
    module name (``layers.0.attn.q_proj``), whether or not the model fuses q/k/v or w1/w3: the layout
    PEFT uses, and what :func:`load_lora_state_dict` reads. Tensors are detached, not copied."""
    out: dict[str, Tensor] = {}
    for path, module in lora_modules(model):
        for name in module.rows:
            key = _canonical(path, name)
            out[f"{key}.lora_A.weight"] = module.lora_A[name].detach()
            out[f"{key}.lora_B.weight"] = module.lora_B[name].detach()
    return out


def load_lora_state_dict(model: nn.Module, state_dict: Mapping[str, Tensor]) -> None:
    """Copy adapters saved by :func:`lora_state_dict` into ``model`` (which has the same adapters applied).
    Every key must match and every shape fit, or nothing is changed (``ValueError`` naming them)."""
    slots: dict[str, Tensor] = {}
    for path, module in lora_modules(model):
        for name in module.rows:
            key = _canonical(path, name)
            slots[f"{key}.lora_A.weight"] = module.lora_A[name]
            slots[f"{key}.lora_B.weight"] = module.lora_B[name]
    missing, unexpected = sorted(set(slots) - set(state_dict)), sorted(set(state_dict) - set(slots))
    if missing or unexpected:
        raise ValueError(f"the adapters do not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    wrong = [
        f"{k}: {tuple(state_dict[k].shape)} for {tuple(v.shape)}"
        for k, v in slots.items()
        if state_dict[k].shape != v.shape
    ]
    if wrong:
        raise ValueError(f"the adapters do not fit the model (another rank?): {'; '.join(wrong[:4])}")
    with torch.no_grad():
        for key, slot in slots.items():
            slot.copy_(state_dict[key])


def merge_lora(model: nn.Module) -> None:
    """Add every adapter into its base weight (see :meth:`LoRALinear.merge`)."""
    for _, module in lora_modules(model):
        module.merge()


def unmerge_lora(model: nn.Module) -> None:
    """Take every merged adapter out of its base weight again."""
    for _, module in lora_modules(model):
        module.unmerge()


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict without adapters and with each update added into its (unfused) weight key,
    the model itself unchanged: what a plain model of the same shape loads to compute the adapted model."""
    state = {k: v for k, v in model.state_dict().items() if ".lora_A." not in k and ".lora_B." not in k}
    with torch.no_grad():
        for path, module in lora_modules(model):
            if module.merged:
                continue
            delta = module.delta_weight().float()
            for name, (start, stop) in module.rows.items():
                key = f"{_canonical(path, name)}.weight"
                state[key] = (state[key].float() + delta[start:stop]).to(state[key].dtype)
    return state


def cast_frozen_weights(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Store each frozen matmul weight (of a ``tlm_linear.Linear`` or a :class:`LoRALinear`) in ``dtype``, in
    place; the names of those cast. For training under autocast to ``dtype``: autocast would cast each of
    them on every forward, so holding them in ``dtype`` gives the same products at half the memory. A weight
    that is trainable, or shared with a module of another kind (an embedding tied to the head), is kept."""
    counts: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
    cast = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, (Linear, LoRALinear)) or not isinstance(weight, nn.Parameter):
            continue
        if weight.requires_grad or weight.dtype == dtype or counts[id(weight)] > 1:
            continue
        weight.data = weight.data.to(dtype)
        cast.append(f"{name}.weight")
    return cast


def base_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of the frozen base (no adapter keys; merged adapters are taken back out first)."""
    if any(m.merged for _, m in lora_modules(model)):
        raise ValueError("the model has merged adapters: unmerge_lora(model) first")
    return {k: v for k, v in model.state_dict().items() if ".lora_A." not in k and ".lora_B." not in k}


def weights_sha256(state_dict: Mapping[str, Tensor]) -> str:
    """SHA-256 of a state dict's names, dtypes, shapes and bytes, in key order: a base model's identity,
    the same whichever file format it was read from."""
    h = hashlib.sha256()
    for key in sorted(state_dict):
        t = state_dict[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
