"""Linear and Embedding layers written from scratch, with the CS336 initialisation."""

from tlm_linear.embedding import Embedding
from tlm_linear.fused import register_split_layout, split_layout
from tlm_linear.linear import Linear, PackedWeights

__version__ = "0.4.1"

__all__ = ["Embedding", "Linear", "PackedWeights", "__version__", "register_split_layout", "split_layout"]
