"""The ops the traffic benchmark and its tests measure: inputs, the fused call, the naive
eager twin, and the compulsory byte minimum of each pass.

Byte model. The compulsory minimum reads each external activation input once and writes
each activation output once:

    forward   in: x, residual, gate            out: out, new_residual (when stored)
    backward  in: p (the saved new_residual,   out: dx (also the residual's gradient),
                  or x), gate, grad_out,            a separate dresidual when its dtype
                  grad_new_residual                 differs from x's, dgate

Weights, biases, the fp32 row statistics and the backward's per-program dw/db partial
rows are not in the minimum: they are counted, and reported apart.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

import fuseblock

from .traffic import charge, uncounted

OPS = ("norm", "add_norm", "add_norm_fp32_residual", "pre_gate", "post_gate", "post_gate_residual")
KINDS = ("rms", "layer")
EPS = 1e-6

# Kernel argument names (fuseblock/kernels/norm.py) by what they hold.
ACTIVATION_ARGS = frozenset({"X", "R", "Y", "O", "RO", "P", "DO", "DRO", "DX", "DR", "DY"})
WEIGHT_ARGS = frozenset({"W", "B"})
STAT_ARGS = frozenset({"RSTD", "MEAN"})
PARTIAL_ARGS = frozenset({"DW", "DB"})


def nbytes(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclasses.dataclass
class Case:
    """One op on fixed inputs; `fused()` and `naive()` return the differentiable outputs."""

    op: str
    kind: str
    x: Tensor
    residual: Optional[Tensor]
    gate: Optional[Tensor]
    weight: Tensor
    bias: Optional[Tensor]
    residual_dtype: Optional[torch.dtype]

    @property
    def gate_position(self) -> Optional[str]:
        return None if self.gate is None else ("pre" if self.op.startswith("pre") else "post")

    @property
    def stores_residual(self) -> bool:
        return self.residual is not None or self.residual_dtype is not None

    @property
    def leaves(self) -> list[Tensor]:
        return [t for t in (self.x, self.residual, self.gate, self.weight, self.bias) if t is not None]

    def fused(self) -> list[Tensor]:
        kw = dict(kind=self.kind, eps=EPS)
        if self.gate is not None:
            kw.update(gate=self.gate, gate_position=self.gate_position)
        if not self.stores_residual:
            return [fuseblock.norm(self.x, self.weight, self.bias, **kw)]
        out, new_res = fuseblock.add_norm(
            self.x, self.residual, self.weight, self.bias, residual_dtype=self.residual_dtype, **kw
        )
        return [out, new_res]

    def naive(self, one_kernel_norm: bool = False) -> list[Tensor]:
        """`x + residual` (torch's type promotion), then torch's own norm and the gate.

        one_kernel_norm: count torch's rms_norm as one kernel each way, as CUDA runs it
        (on the CPU it is a composite of elementwise ops and reductions)."""
        p = self.x if self.residual is None else self.x + self.residual
        g = None if self.gate is None else F.silu(self.gate)
        s = p * g if self.gate_position == "pre" else p
        d = s.shape[-1]
        w = self.weight.to(s.dtype)
        if self.kind == "rms" and one_kernel_norm:
            out = _OneKernelRMSNorm.apply(s, w)
        elif self.kind == "rms":
            out = F.rms_norm(s, (d,), w, EPS)
        else:
            out = F.layer_norm(s, (d,), w, None if self.bias is None else self.bias.to(s.dtype), EPS)
        out = out.to(self.x.dtype)  # the stream's norm output has the activations' dtype
        if self.gate_position == "post":
            out = out * g
        return [out, p] if self.stores_residual else [out]

    def grad_outputs(self, outs: list[Tensor]) -> list[Tensor]:
        gen = torch.Generator().manual_seed(1)
        return [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]

    def minimum(self) -> tuple[int, int]:
        """Compulsory (forward, backward) bytes: see the module docstring."""
        n, act = self.x.numel(), self.x.element_size()  # out, grad_out and dx are like x
        res = 0  # bytes of new_residual, and of its gradient
        if self.stores_residual:
            res = n * (self.residual_dtype or self.x.dtype).itemsize
        p = res or n * act
        separate = self.residual is not None and self.residual.dtype != self.x.dtype
        fwd = n * act + nbytes(self.residual) + nbytes(self.gate) + n * act + res
        bwd = p + nbytes(self.gate) + n * act + res + n * act + (nbytes(self.residual) if separate else 0) + nbytes(self.gate)
        return fwd, bwd


class _OneKernelRMSNorm(torch.autograd.Function):
    """rms_norm charged as one kernel: forward reads x, w and writes out, rstd; backward
    reads grad_out, x, rstd, w and writes dx, dw."""

    @staticmethod
    def forward(ctx, x, w):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        with uncounted():
            rstd = torch.rsqrt(x.to(acc).square().mean(-1, keepdim=True) + EPS)  # (M, 1)
            out = (x.to(acc) * rstd * w.to(acc)).to(x.dtype)
        charge("rms_norm (one kernel)", [x, w], [out, rstd])
        ctx.save_for_backward(x, w, rstd)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w, rstd = ctx.saved_tensors
        with uncounted():
            r = x.to(rstd.dtype) * rstd
            dr = dout.to(rstd.dtype) * w.to(rstd.dtype)
            dx = (rstd * (dr - r * (dr * r).mean(-1, keepdim=True))).to(x.dtype)
            dw = (dout.to(rstd.dtype) * r).sum(0).to(w.dtype)
        charge("rms_norm_backward (one kernel)", [dout, x, rstd, w], [dx, dw])
        return dx, dw


def make_case(op: str, rows: int, d: int, dtype: torch.dtype, kind: str = "rms", seed: int = 0) -> Case:
    """Inputs for `op` (one of OPS) with `rows` rows of width d; parameters in dtype.

    add_norm_fp32_residual keeps the residual stream in fp32 under x in `dtype`."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    gen = torch.Generator().manual_seed(seed)

    def leaf(shape, dt):
        return torch.randn(shape, generator=gen).to(dt).requires_grad_()

    has_res = op in ("add_norm", "add_norm_fp32_residual", "post_gate_residual")
    fp32_res = op == "add_norm_fp32_residual"
    return Case(
        op=op,
        kind=kind,
        x=leaf((rows, d), dtype),
        residual=leaf((rows, d), torch.float32 if fp32_res else dtype) if has_res else None,
        gate=leaf((rows, d), dtype) if "gate" in op else None,
        weight=(1 + 0.1 * torch.randn(d, generator=gen)).to(dtype).requires_grad_(),
        bias=leaf((d,), dtype) if kind == "layer" else None,
        residual_dtype=torch.float32 if fp32_res else None,
    )
