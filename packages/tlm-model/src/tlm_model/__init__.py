"""The composition layer of tlm: ModelConfig and its presets, the pre-norm Transformer block, the LM,
its loss, generation, the model file and HF Llama interop.

Names load on first use (PEP 562): ``from tlm_model import ModelConfig`` (or
``PRESETS``) imports the config alone, with no torch, which a command line that only parses its flags
relies on; the modules load on first use of a name from them.
"""

from typing import TYPE_CHECKING

from tlm_core.lazy import lazy_exports

__version__ = "0.4.0"

_HOMES = {
    "PRESETS": "tlm_model.config",
    "ModelConfig": "tlm_model.config",
    "InferenceModel": "tlm_model.inference",
    "compile_for_inference": "tlm_model.inference",
    "TransformerBlock": "tlm_model.block",
    "TransformerLM": "tlm_model.lm",
    "unwrap": "tlm_model.inference",
    "chunked_cross_entropy": "tlm_model.loss",
    "cross_entropy": "tlm_model.cross_entropy",
    "document_ids": "tlm_attention.documents",
    "from_hf": "tlm_model.interop",
    "save_hf": "tlm_model.interop",
    "generate": "tlm_model.generate",
    "sample_next_token": "tlm_model.generate",
    "DecodeBatch": "tlm_model.batching",
    "load_model_file": "tlm_model.checkpoint",
    "save_model_file": "tlm_model.checkpoint",
}

__all__ = [
    "PRESETS",
    "DecodeBatch",
    "InferenceModel",
    "ModelConfig",
    "TransformerBlock",
    "TransformerLM",
    "__version__",
    "chunked_cross_entropy",
    "compile_for_inference",
    "cross_entropy",
    "document_ids",
    "from_hf",
    "generate",
    "load_model_file",
    "sample_next_token",
    "save_hf",
    "save_model_file",
    "unwrap",
]

if TYPE_CHECKING:
    from tlm_attention.documents import document_ids
    from tlm_model.batching import DecodeBatch
    from tlm_model.block import TransformerBlock
    from tlm_model.checkpoint import load_model_file, save_model_file
    from tlm_model.config import PRESETS, ModelConfig
    from tlm_model.cross_entropy import cross_entropy
    from tlm_model.generate import generate, sample_next_token
    from tlm_model.inference import InferenceModel, compile_for_inference, unwrap
    from tlm_model.interop import from_hf, save_hf
    from tlm_model.lm import TransformerLM
    from tlm_model.loss import chunked_cross_entropy


lazy_exports(__name__, _HOMES)
