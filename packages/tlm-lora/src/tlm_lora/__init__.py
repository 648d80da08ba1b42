"""LoRA adapters for tlm models: frozen base weights plus trainable low-rank updates, fused layers included."""

from tlm_lora.lora import (
    MODULE_OF_ROLE,
    ROLES,
    LoRALinear,
    apply_lora,
    base_state_dict,
    check_targets,
    load_lora_state_dict,
    lora_modules,
    lora_state_dict,
    merge_lora,
    merged_state_dict,
    unmerge_lora,
    weights_sha256,
)

__version__ = "0.1.0"

__all__ = [
    "MODULE_OF_ROLE",
    "ROLES",
    "LoRALinear",
    "__version__",
    "apply_lora",
    "base_state_dict",
    "check_targets",
    "load_lora_state_dict",
    "lora_modules",
    "lora_state_dict",
    "merge_lora",
    "merged_state_dict",
    "unmerge_lora",
    "weights_sha256",
]
