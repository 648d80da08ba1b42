"""Keep a fused weight's checkpoint layout split: one matmul at run time, separate keys on disk.

Fusing projections that read the same input (q/k/v, or SwiGLU's w1/w3) into one ``Linear`` turns
several GEMMs into one larger, better-shaped one. Checkpoints should not notice: the hooks installed
here make ``state_dict()`` emit the separate ``{part}.weight`` keys and ``load_state_dict`` accept
them (or the fused key), the way gpt-fast folds wq/wk/wv in a load hook.
"""

from typing import Any

import torch
from torch import nn


class _Layout:
    # Callable objects, not closures, so that a module carrying the hooks still pickles and
    # torch.save()s whole (and torch can mark them as registered through its public API).
    def __init__(self, fused: str, parts: dict[str, int]) -> None:
        self.names, self.sizes = list(parts), list(parts.values())
        self.fused_key = f"{fused}.weight"


class _Split(_Layout):
    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        weight = state_dict.pop(prefix + self.fused_key)
        for name, block in zip(self.names, torch.split(weight, self.sizes, dim=0), strict=True):
            # Separate storage: savers such as safetensors refuse tensors that share memory.
            state_dict[f"{prefix}{name}.weight"] = block.clone()


class _Join(_Layout):
    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        keys = [f"{prefix}{name}.weight" for name in self.names]
        if prefix + self.fused_key not in state_dict and all(k in state_dict for k in keys):
            state_dict[prefix + self.fused_key] = torch.cat([state_dict.pop(k) for k in keys], dim=0)


def register_split_layout(module: nn.Module, fused: str, parts: dict[str, int]) -> None:
    """Present ``module.<fused>.weight`` as the row blocks ``<part>.weight`` in state dicts.

    ``parts`` maps each part name to its number of rows, in the order the rows are stacked in
    the fused weight; the row counts must add up to the fused weight's ``out_features``.
    """
    module.register_state_dict_post_hook(_Split(fused, parts))
    module.register_load_state_dict_pre_hook(_Join(fused, parts))
    layouts = module.__dict__.setdefault(_LAYOUTS, {})
    layouts[fused] = dict(parts)


#: The instance attribute where :func:`register_split_layout` records each fused weight's parts.
_LAYOUTS = "_tlm_split_layouts"


def split_layout(module: nn.Module, fused: str) -> dict[str, int] | None:
    """The parts ``register_split_layout(module, fused, parts)`` registered (name -> rows, in stacking
    order), or None when ``module.<fused>`` is not a fused weight. Lets code that acts on the parts of a
    fused projection (a LoRA adapter on q and v of a fused q/k/v) find them without unfusing anything."""
    layout = module.__dict__.get(_LAYOUTS, {}).get(fused)
    return None if layout is None else dict(layout)
