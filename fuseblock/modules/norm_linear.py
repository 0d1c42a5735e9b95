"""`NormLinear`: a norm fused with the Linear after it, as a module.

The op it runs is `fuseblock.norm_linear` (fuseblock.ops.norm_linear).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..ops.checks import (
    check_flag,
    check_float_dtype,
    check_int,
    check_last_dim,
    check_number,
    check_options,
    linear_recipe,
)
from ..ops.norm_linear import norm_linear
from ..spec import DEFAULT_GATE_ACT, DEFAULT_GATE_POSITION, Fp8Recipe

__all__ = ["NormLinear"]


class NormLinear(nn.Module):
    """A norm fused with the Linear after it: `forward(x, residual=None) -> (y, new_residual)`,
    `new_residual = x + residual` and `y = Linear(norm(new_residual))`, saving for backward
    p and the row statistics but not the norm's output (see `norm_linear`).

    Parameters: `weight` (out_features, in_features) and `bias` (out_features), named
    and initialised as nn.Linear's; `norm_weight` (in_features), initialised so that
    weight_offset + norm_weight = 1; `norm_bias` when norm_bias=True, zeros.

    quant="fp8_row" or "mxfp8", or a `fuseblock.Fp8Recipe` of either: the Linear runs in
    fp8 (the rowwise recipe, or MX blocks of 32), the norm writing its rows as fp8 in its
    own launch; gradients in high precision (see `norm_linear`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        kind: str = "rms",
        eps: float | None = None,
        norm_bias: bool = False,
        weight_offset: float = 0.0,
        residual_dtype: torch.dtype | None = None,
        quant: str | Fp8Recipe | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        check_int("in_features", in_features)
        check_int("out_features", out_features)
        check_flag("bias", bias)
        check_flag("norm_bias", norm_bias)
        check_number("weight_offset", weight_offset)
        check_float_dtype("dtype", dtype)
        check_float_dtype("residual_dtype", residual_dtype)
        check_options(in_features, kind=kind, c=None, eps=0.0 if eps is None else eps, num_groups=1,
                      gate_act=DEFAULT_GATE_ACT, gate_position=DEFAULT_GATE_POSITION)  # eps=None: torch's, per call
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.kind, self.eps, self.weight_offset = kind, None if eps is None else float(eps), float(weight_offset)
        self.residual_dtype = residual_dtype
        linear_recipe(quant)  # validated here, once: a mistake is named where the module is built
        self.quant = quant
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.norm_weight = nn.Parameter(torch.empty(in_features, **factory))
        self.norm_bias = nn.Parameter(torch.empty(in_features, **factory)) if norm_bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every parameter's initial value: the Linear's weight and bias as nn.Linear
        initialises them (uniform, bound 1/sqrt(in_features) for both), the norm's weight
        so that weight_offset + norm_weight = 1 and its bias zeros. Called by __init__;
        call it again after building on the meta device and `to_empty`."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)
        nn.init.constant_(self.norm_weight, 1.0 - self.weight_offset)
        if self.norm_bias is not None:
            nn.init.zeros_(self.norm_bias)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        check_last_dim(x, self.in_features)
        return norm_linear(x, residual, self.norm_weight, self.norm_bias, self.weight, self.bias, kind=self.kind,
                           eps=self.eps, weight_offset=self.weight_offset, residual_dtype=self.residual_dtype,
                           quant=self.quant)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kind={self.kind!r}, eps={self.eps}, norm_bias={self.norm_bias is not None}"
                + (f", weight_offset={self.weight_offset}" if self.weight_offset else "")
                + ("" if self.residual_dtype is None else f", residual_dtype={self.residual_dtype}")
                + ("" if self.quant is None else f", quant={self.quant!r}"))
