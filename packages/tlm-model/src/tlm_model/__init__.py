"""The composition layer of tlm: pre-norm Transformer block, Transformer LM and presets."""

from tlm_model.block import TransformerBlock
from tlm_model.config import PRESETS, ModelConfig
from tlm_model.lm import TransformerLM

__version__ = "0.1.0"

__all__ = ["PRESETS", "ModelConfig", "TransformerBlock", "TransformerLM", "__version__"]
