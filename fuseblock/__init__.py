"""fuseblock: fused residual-add + normalization kernels and the fused pre-norm residual stream."""
from .attn_res_stream import AttnResStack
from .convert import norm_from
from .family import (
    BatchNorm,
    InstanceNorm,
    batch_norm,
    embed_norm,
    group_norm,
    instance_norm,
)
from .fp8 import Quantized
from .hyper_stream import HyperConnectionStack
from .modules import AddNorm, Norm
from .norm_linear import NormLinear
from .ops.attn_res import attn_res_add_norm, attn_res_norm
from .ops.hyper import hc_add_norm, hc_head, hc_norm
from .ops.norm import add_norm, norm
from .ops.norm_add import norm_add, norm_add_norm
from .ops.norm_linear import norm_linear  # after .norm_linear: `fuseblock.norm_linear` is the op, not the module
from .stream import PreNormBlock, ResidualStack
from .swap import SwapReport, swap_norms

__all__ = ["norm", "add_norm", "Norm", "AddNorm", "PreNormBlock", "ResidualStack", "norm_from"]
__all__ += ["norm_add", "norm_add_norm"]
__all__ += ["norm_linear", "NormLinear"]
__all__ += ["swap_norms", "SwapReport"]
__all__ += ["Quantized"]
__all__ += ["hc_add_norm", "hc_norm", "hc_head"]
__all__ += ["HyperConnectionStack"]
__all__ += ["attn_res_norm", "attn_res_add_norm", "AttnResStack"]
__all__ += ["embed_norm", "batch_norm", "group_norm", "instance_norm", "BatchNorm", "InstanceNorm"]
__version__ = "0.3.0"
