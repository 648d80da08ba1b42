"""Deprecated: opening any artifact (run, step, model file, HF folder, LoRA run, PEFT adapter) moved to the
package ``tlm_artifacts``, which inference uses without tlm-train. This module re-exports it for one minor
version and warns on import; import ``tlm_artifacts`` instead."""

import warnings

from tlm_artifacts.artifact import (
    KINDS,
    Artifact,
    UnreadableTokenizer,
    load_model,
    load_tokenizer,
    lora_step,
    model_config,
    model_file,
    resolve,
)

__all__ = [
    "KINDS", "Artifact", "UnreadableTokenizer", "load_model", "load_tokenizer", "lora_step", "model_config",
    "model_file", "resolve",
]  # fmt: skip

warnings.warn(
    "tlm_train.artifacts is deprecated: import tlm_artifacts (the same resolve, load_model, load_tokenizer, ...)",
    DeprecationWarning,
    stacklevel=2,
)
