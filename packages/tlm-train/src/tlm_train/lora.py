"""LoRA runs: the settings a ``--lora-rank`` run records. Reading LoRA step folders and PEFT adapter folders is
``tlm_artifacts.lora``'s (re-exported here for the code that imported it from tlm-train 0.3)."""

from typing import Any

from tlm_artifacts.artifact import load_base, load_lora_step, load_peft
from tlm_artifacts.layout import ADAPTER_NAME, PEFT_CONFIG, PEFT_WEIGHTS
from tlm_artifacts.lora import (
    PEFT_MODULE_OF_ROLE,
    BaseModelError,
    adapt,
    adapter_bytes,
    file_sha256,
    grown,
    is_adapter_key,
    is_peft_folder,
    load_named_adapters,
    peft_base_path,
    peft_config,
    peft_settings,
    read_adapter_file,
)

__all__ = [
    "ADAPTER_NAME", "PEFT_CONFIG", "PEFT_MODULE_OF_ROLE", "PEFT_WEIGHTS", "BaseModelError", "adapt", "adapter_bytes",
    "file_sha256", "grown", "is_adapter_key", "is_peft_folder", "load_base", "load_lora_step", "load_named_adapters",
    "load_peft", "peft_base_path", "peft_config", "peft_settings", "read_adapter_file", "settings",
]  # fmt: skip


def settings(config: Any) -> dict[str, Any]:
    """The LoRA settings a TrainConfig asks for, as a train state records them."""
    return {
        "rank": config.lora_rank,
        "alpha": float(config.lora_rank if config.lora_alpha is None else config.lora_alpha),
        "targets": config.lora_targets,
        "dropout": config.lora_dropout,
    }
