"""fuseblock: fused residual-add + normalization kernels and the fused pre-norm residual stream."""
from .attn_res_stream import AttnResStack
from .blocks import StreamPair, fuse_blocks, unfuse_blocks
from .convert import norm_from
from .hyper_stream import HyperConnectionStack
from .modules.channel_norm import BatchNorm, InstanceNorm
from .modules.norm import AddNorm, Norm
from .modules.norm_linear import NormLinear
from .ops.attn_res import attn_res_add_norm, attn_res_norm
from .ops.channel_norm import batch_norm, group_norm, instance_norm
from .ops.embed_norm import embed_norm
from .ops.hyper import hc_add_norm, hc_head, hc_norm
from .ops.norm import add_norm, norm
from .ops.norm_add import norm_add, norm_add_norm
from .ops.norm_linear import norm_linear
from .reference.fp8 import Quantized
from .spec import Fp8Recipe
from .stream import PreNormBlock, ResidualStack
from .swap import SwapReport, swap_norms

__all__ = ["norm", "add_norm", "Norm", "AddNorm", "PreNormBlock", "ResidualStack", "norm_from"]
__all__ += ["norm_add", "norm_add_norm"]
__all__ += ["norm_linear", "NormLinear"]
__all__ += ["swap_norms", "SwapReport"]
__all__ += ["fuse_blocks", "unfuse_blocks", "StreamPair"]
__all__ += ["Quantized", "Fp8Recipe"]
__all__ += ["hc_add_norm", "hc_norm", "hc_head"]
__all__ += ["HyperConnectionStack"]
__all__ += ["attn_res_norm", "attn_res_add_norm", "AttnResStack"]
__all__ += ["embed_norm", "batch_norm", "group_norm", "instance_norm", "BatchNorm", "InstanceNorm"]
__version__ = "0.4.0"
