"""LoRA adapters for tlm models: frozen base weights plus trainable low-rank updates, fused layers included.

Names load on first use (PEP 562): ``from tlm_lora.roles import ROLES, check_targets`` costs no torch import,
which a training config that only names the targets relies on.
"""

from typing import TYPE_CHECKING

from tlm_core.lazy import lazy_exports

__version__ = "0.1.0"

__all__ = [
    "MODULE_OF_ROLE",
    "ROLES",
    "LoRALinear",
    "__version__",
    "apply_lora",
    "base_state_dict",
    "cast_frozen_weights",
    "check_targets",
    "load_lora_state_dict",
    "lora_modules",
    "lora_state_dict",
    "merge_lora",
    "merged_state_dict",
    "unmerge_lora",
    "weights_sha256",
]

_HOMES = {name: "tlm_lora.lora" for name in __all__ if name != "__version__"}
_HOMES.update({name: "tlm_lora.roles" for name in ("MODULE_OF_ROLE", "ROLES", "check_targets")})

if TYPE_CHECKING:
    from tlm_lora.lora import (
        LoRALinear,
        apply_lora,
        base_state_dict,
        cast_frozen_weights,
        load_lora_state_dict,
        lora_modules,
        lora_state_dict,
        merge_lora,
        merged_state_dict,
        unmerge_lora,
        weights_sha256,
    )
    from tlm_lora.roles import MODULE_OF_ROLE, ROLES, check_targets


lazy_exports(__name__, _HOMES)
