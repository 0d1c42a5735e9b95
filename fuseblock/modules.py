"""nn.Module wrappers over the functional ops: `Norm` and `AddNorm`.

Parameters are named `weight` and `bias`, so state_dicts load from nn.RMSNorm and
nn.LayerNorm (and back).
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops.norm import add_norm, norm
from .ops.spec import DEFAULT_GATE_ACT, DEFAULT_GATE_POSITION, FLOAT_DTYPES, check_options


def check_dim(dim) -> None:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")


def check_factory_dtype(dtype) -> None:
    """The `dtype=` of a module's parameters: None (torch's default) or a floating dtype."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be None or a floating dtype {FLOAT_DTYPES}, got {dtype!r}")


def check_flag(name: str, flag) -> None:
    """A module switch such as affine=: a bool, never a truthy string or a tensor."""
    if not isinstance(flag, bool):
        raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")


def check_last_dim(x, dim: int) -> None:
    """x's last dim against the module's: named so, rather than blaming weight's shape."""
    if isinstance(x, Tensor) and x.dim() > 0 and x.shape[-1] != dim:
        raise ValueError(f"x's last dim {x.shape[-1]} does not match the module's dim {dim}")


def check_residual_dtype(residual_dtype) -> None:
    if residual_dtype is not None and residual_dtype not in FLOAT_DTYPES:
        raise TypeError(f"residual_dtype must be None or one of {FLOAT_DTYPES}, got {residual_dtype!r}")


class Norm(nn.Module):
    """Normalize over the last dim: RMSNorm (kind="rms"), LayerNorm ("layer") or L2 ("l2").

    `forward(x, gate=None)`; a gate applies `gate_act` at `gate_position` (see fuseblock.norm).
    """

    def __init__(
        self,
        dim: int,
        *,
        kind: str = "rms",
        c: Optional[float] = None,
        eps: float = 1e-6,
        weight: bool = True,
        bias: bool = False,
        num_groups: int = 1,
        gate_act: str = DEFAULT_GATE_ACT,
        gate_position: str = DEFAULT_GATE_POSITION,
        device=None,
        dtype=None,
    ):
        super().__init__()
        check_dim(dim)
        check_flag("weight", weight)  # whether the parameter exists; a tensor here is a mistaken initial value
        check_flag("bias", bias)
        check_factory_dtype(dtype)
        check_options(dim, kind=kind, c=c, eps=eps, num_groups=num_groups, gate_act=gate_act, gate_position=gate_position)
        self.dim, self.kind, self.c, self.eps = int(dim), kind, c, float(eps)
        self.num_groups, self.gate_act, self.gate_position = int(num_groups), gate_act, gate_position
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.ones(dim, **factory)) if weight else None
        self.bias = nn.Parameter(torch.zeros(dim, **factory)) if bias else None

    def _kwargs(self, gate: Optional[Tensor]) -> dict:
        kw = dict(kind=self.kind, c=self.c, eps=self.eps, num_groups=self.num_groups, gate=gate)
        if gate is not None:
            kw.update(gate_act=self.gate_act, gate_position=self.gate_position)
        return kw

    def forward(self, x: Tensor, gate: Optional[Tensor] = None) -> Tensor:
        check_last_dim(x, self.dim)
        return norm(x, self.weight, self.bias, **self._kwargs(gate))

    def naive(self, x: Tensor) -> Tensor:
        """The same function (without a gate) as eager torch ops, unfused: the naive stream's norm."""
        d = x.shape[-1]
        w = None if self.weight is None else self.weight.to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        default_c = self.c is None and self.num_groups == 1
        if default_c and self.kind == "rms":
            out = F.rms_norm(x, (d,), w, self.eps)
            return out if b is None else out + b
        if default_c and self.kind == "layer":
            return F.layer_norm(x, (d,), w, b, self.eps)
        xg = x.unflatten(-1, (self.num_groups, d // self.num_groups))
        q = xg - xg.mean(-1, keepdim=True) if self.kind == "layer" else xg
        group = d // self.num_groups
        c = self.c if self.c is not None else (1.0 if self.kind == "l2" else math.sqrt(group))
        out = (q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps) * (c / math.sqrt(group))).flatten(-2)
        if w is not None:
            out = out * w
        return out if b is None else out + b

    def extra_repr(self) -> str:
        return (
            f"{self.dim}, kind={self.kind!r}, eps={self.eps}, weight={self.weight is not None}, "
            f"bias={self.bias is not None}" + (f", num_groups={self.num_groups}" if self.num_groups > 1 else "")
        )


class AddNorm(Norm):
    """Fused residual add + normalize: `forward(x, residual=None, gate=None) -> (out, new_residual)`.

    new_residual = x + residual, kept in `residual_dtype`. By default that is the dtype
    torch's `x + residual` would have, so an fp32 residual is never rounded to bf16
    activations (fuseblock.add_norm's default is x's dtype). out has x's dtype.
    """

    def __init__(self, dim: int, *, residual_dtype: Optional[torch.dtype] = None, **kwargs):
        super().__init__(dim, **kwargs)
        check_residual_dtype(residual_dtype)
        self.residual_dtype = residual_dtype

    def forward(self, x: Tensor, residual: Optional[Tensor] = None, gate: Optional[Tensor] = None):
        rdtype = self.residual_dtype
        if rdtype is None and isinstance(residual, Tensor) and isinstance(x, Tensor):
            rdtype = torch.promote_types(x.dtype, residual.dtype)
        check_last_dim(x, self.dim)
        return add_norm(x, residual, self.weight, self.bias, residual_dtype=rdtype, **self._kwargs(gate))

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.residual_dtype is None else f", residual_dtype={self.residual_dtype}")
