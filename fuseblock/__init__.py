"""fuseblock: fused residual-add + normalization kernels and the fused pre-norm residual stream."""
from .ops.norm import add_norm, norm

__all__ = ["norm", "add_norm"]
__version__ = "0.1.0"
