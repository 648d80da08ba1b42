"""The composition layer of tlm: ModelConfig and its presets, the pre-norm Transformer block, the LM,
its loss, generation, the model file and HF Llama interop."""

from tlm_model.batching import DecodeBatch
from tlm_model.block import TransformerBlock
from tlm_model.checkpoint import load_checkpoint, save_checkpoint
from tlm_model.config import PRESETS, ModelConfig
from tlm_model.cross_entropy import cross_entropy
from tlm_model.generate import generate, sample_next_token
from tlm_model.inference import InferenceModel, compile_for_inference
from tlm_model.interop import from_hf, save_hf
from tlm_model.lm import TransformerLM, unwrap
from tlm_model.loss import chunked_cross_entropy

__version__ = "0.4.0"

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
    "from_hf",
    "generate",
    "load_checkpoint",
    "sample_next_token",
    "save_checkpoint",
    "save_hf",
    "unwrap",
]
