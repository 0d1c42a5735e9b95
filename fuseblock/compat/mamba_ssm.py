"""mamba's gated norm entry points (`mamba_ssm.ops.triton.layernorm_gated`, used by Mamba2
and Mamba3), with the same signatures, on `fuseblock.norm`: code that calls them swaps one
import, or `fuseblock.compat.patch("mamba_ssm")` swaps them in every module of mamba.

    from fuseblock.compat.mamba_ssm import LayerNorm, RMSNorm, layernorm_fn, rmsnorm_fn

What they compute (N an RMS norm, or a layer norm with is_rms_norm=False, over groups of
group_size channels, the whole last dim with group_size=None):

    norm_before_gate=True:   y = N(x) * w + b, times silu(z)   (fuseblock's gate_position="post")
    norm_before_gate=False:  y = N(x * silu(z)) * w + b        (gate_position="pre")
    no z: y = N(x) * w + b

y has x's dtype; eps defaults to 1e-6 in the functions, 1e-5 in the modules, as there.
A group_size that does not divide the width is a ValueError naming it.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.checks import check_flag
from ..ops.norm import norm


def layernorm_fn(x: Tensor, weight: Tensor | None, bias: Tensor | None, z: Tensor | None = None, eps: float = 1e-6,
                 group_size: int | None = None, norm_before_gate: bool = True, is_rms_norm: bool = False) -> Tensor:
    """mamba's layernorm_gated.layernorm_fn: one fuseblock.norm call (module docstring)."""
    check_flag("norm_before_gate", norm_before_gate)
    check_flag("is_rms_norm", is_rms_norm)
    d = x.shape[-1] if isinstance(x, Tensor) and x.dim() else None
    groups = 1
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or (
                d is not None and d % group_size):
            raise ValueError(f"group_size must be a positive int dividing the last dim ({d}), got {group_size!r}")
        groups = d // group_size if d is not None else 1
    return norm(x, weight, bias, kind="rms" if is_rms_norm else "layer", eps=eps, gate=z, gate_act="silu",
                gate_position="post" if norm_before_gate else "pre", num_groups=groups)


def rmsnorm_fn(x: Tensor, weight: Tensor | None, bias: Tensor | None, z: Tensor | None = None, eps: float = 1e-6,
               group_size: int | None = None, norm_before_gate: bool = True) -> Tensor:
    """mamba's layernorm_gated.rmsnorm_fn: layernorm_fn with is_rms_norm=True."""
    return layernorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate, True)


class LayerNorm(nn.Module):
    """mamba's gated LayerNorm module: `forward(x, z=None)`; weight ones, bias zeros."""

    is_rms_norm = False

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None):
        super().__init__()
        check_flag("norm_before_gate", norm_before_gate)
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        if self.is_rms_norm:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        return layernorm_fn(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                            norm_before_gate=self.norm_before_gate, is_rms_norm=self.is_rms_norm)


class RMSNorm(LayerNorm):
    """mamba's gated RMSNorm module: `forward(x, z=None)`; weight ones, no bias."""

    is_rms_norm = True
