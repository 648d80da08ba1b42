"""One reader for every model artifact tlm opens: a model file or folder, an HF Llama folder, a step folder (one
model file or DCP shards), a run folder, a LoRA run and a PEFT adapter beside its base.

``resolve(path)`` says what a path is (an :class:`Artifact` with a ``kind``); ``load_model``, ``load_tokenizer``
and ``model_config`` open it. The read side of the formats ``tlm train`` writes lives here too
(:mod:`tlm_artifacts.layout`, :mod:`.train_state`, :mod:`.steps`, :mod:`.lora`); nothing here writes, and nothing
here needs tlm-train.

Names load on first use (PEP 562): ``tlm_artifacts.layout`` imports without torch.
"""

from typing import TYPE_CHECKING

from tlm_core.lazy import lazy_exports

__version__ = "0.1.0"

_HOMES = {
    "KINDS": "tlm_artifacts.artifact",
    "Artifact": "tlm_artifacts.artifact",
    "UnreadableTokenizer": "tlm_artifacts.artifact",
    "load_model": "tlm_artifacts.artifact",
    "load_tokenizer": "tlm_artifacts.artifact",
    "lora_step": "tlm_artifacts.artifact",
    "model_config": "tlm_artifacts.artifact",
    "model_file": "tlm_artifacts.artifact",
    "resolve": "tlm_artifacts.artifact",
    "RunFolder": "tlm_artifacts.layout",
    "BaseModelError": "tlm_artifacts.lora",
    "StepFolders": "tlm_artifacts.steps",
    "load_step_model": "tlm_artifacts.artifact",
    "read_model_state": "tlm_artifacts.steps",
    "load_train_state": "tlm_artifacts.train_state",
}

__all__ = [
    "KINDS",
    "Artifact",
    "BaseModelError",
    "RunFolder",
    "StepFolders",
    "UnreadableTokenizer",
    "__version__",
    "load_model",
    "load_step_model",
    "load_tokenizer",
    "load_train_state",
    "lora_step",
    "model_config",
    "model_file",
    "read_model_state",
    "resolve",
]

if TYPE_CHECKING:
    from tlm_artifacts.artifact import (
        KINDS,
        Artifact,
        UnreadableTokenizer,
        load_model,
        load_step_model,
        load_tokenizer,
        lora_step,
        model_config,
        model_file,
        resolve,
    )
    from tlm_artifacts.layout import RunFolder
    from tlm_artifacts.lora import BaseModelError
    from tlm_artifacts.steps import StepFolders, read_model_state
    from tlm_artifacts.train_state import load_train_state


lazy_exports(__name__, _HOMES)
