"""nn.Module wrappers over the functional ops: `Norm` and `AddNorm`.

Parameters are named `weight` and `bias`, so state_dicts load from nn.RMSNorm and
nn.LayerNorm (and back).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from . import reference
from .ops.checks import (
    check_flag,
    check_float_dtype,
    check_int,
    check_last_dim,
    check_options,
)
from .ops.norm import add_norm, norm
from .spec import DEFAULT_GATE_ACT, DEFAULT_GATE_POSITION, NormSpec


class Norm(nn.Module):
    """Normalize over the last dim: RMSNorm (kind="rms"), LayerNorm ("layer") or L2 ("l2").

    `forward(x, gate=None)`; a gate applies `gate_act` at `gate_position` (see fuseblock.norm).
    """

    def __init__(
        self,
        dim: int,
        *,
        kind: str = "rms",
        c: float | None = None,
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
        check_int("dim", dim)
        check_flag("weight", weight)  # whether the parameter exists; a tensor here is a mistaken initial value
        check_flag("bias", bias)
        check_float_dtype("dtype", dtype)
        check_options(dim, kind=kind, c=c, eps=eps, num_groups=num_groups, gate_act=gate_act,
                      gate_position=gate_position)
        self.dim, self.kind, self.c, self.eps = int(dim), kind, c, float(eps)
        self.num_groups, self.gate_act, self.gate_position = int(num_groups), gate_act, gate_position
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(dim, **factory)) if weight else None
        self.bias = nn.Parameter(torch.empty(dim, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The initial values: weight ones, bias zeros. Called by __init__; call it again after
        building on the meta device and `to_empty` (FSDP2's deferred init), as torch's norms do."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _kwargs(self, gate: Tensor | None) -> dict:
        kw = dict(kind=self.kind, c=self.c, eps=self.eps, num_groups=self.num_groups, gate=gate)
        if gate is not None:
            kw.update(gate_act=self.gate_act, gate_position=self.gate_position)
        return kw

    def forward(self, x: Tensor, gate: Tensor | None = None) -> Tensor:
        check_last_dim(x, self.dim)
        return norm(x, self.weight, self.bias, **self._kwargs(gate))

    def naive(self, x: Tensor) -> Tensor:
        """The same function (without a gate) on the torch path's plain ops, never the fused
        kernels: the naive stream's norm."""
        spec = NormSpec.of(self.dim, kind=self.kind, c=self.c, eps=self.eps, num_groups=self.num_groups,
                           gate_act=None, gate_position=None)
        return reference.norm_fwd(x, None, None, self.weight, self.bias, spec, None, need_stats=False)[0]

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

    def __init__(self, dim: int, *, residual_dtype: torch.dtype | None = None, **kwargs):
        super().__init__(dim, **kwargs)
        check_float_dtype("residual_dtype", residual_dtype)
        self.residual_dtype = residual_dtype

    def forward(self, x: Tensor, residual: Tensor | None = None, gate: Tensor | None = None):
        rdtype = self.residual_dtype
        if rdtype is None and isinstance(residual, Tensor) and isinstance(x, Tensor):
            rdtype = torch.promote_types(x.dtype, residual.dtype)
        check_last_dim(x, self.dim)
        return add_norm(x, residual, self.weight, self.bias, residual_dtype=rdtype, **self._kwargs(gate))

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.residual_dtype is None else f", residual_dtype={self.residual_dtype}")
