"""The nn.Module layers over the ops, one module per op family."""
from .channel_norm import BatchNorm, InstanceNorm
from .norm import AddNorm, Norm
from .norm_linear import NormLinear

__all__ = ["Norm", "AddNorm", "NormLinear", "BatchNorm", "InstanceNorm"]
