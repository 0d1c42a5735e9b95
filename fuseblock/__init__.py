"""fuseblock: fused residual-add + normalization kernels and the fused pre-norm residual stream."""
from .modules import AddNorm, Norm
from .ops.norm import add_norm, norm
from .stream import PreNormBlock, ResidualStack

__all__ = ["norm", "add_norm", "Norm", "AddNorm", "PreNormBlock", "ResidualStack"]
__version__ = "0.1.0"
