"""Root-mean-square layer normalisation."""

from tlm_norm.rmsnorm import RMSNorm

__version__ = "0.4.0"

__all__ = ["RMSNorm", "__version__"]
