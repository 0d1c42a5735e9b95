"""The scaled fp8 output of `norm` / `add_norm` / `norm_add_norm` (quant=...): the call,
forward and backward. (The keywords are validated into the spec by `checks.resolve`.)

The quantized forward is one kernel launch on the Triton path (`fuseblock.kernels.fp8`)
and `fuseblock.reference.fp8.quantize` of the fp32 normed output on the torch path; the two give
the same codes and scales bit for bit. The codes carry no gradient. When an input
requires one, the result's `Quantized.anchor` stands for the normed output in the graph:
the gradient given to it (in high precision, the unquantized output's dtype) reaches the
unquantized op's backward, which computes dx, dresidual, dweight and dbias from the saved
input and row statistics as it does without quant= (kernel path: the same backward
kernels; torch path: autograd through the reference's composition).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..reference import fp8
from ..reference import norm as reference
from ..spec import NormSpec, Quant
from .dispatch import func_transforms_active, kernels, uses_triton
from .registry import FusedOp


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _anchor_of(x: Tensor) -> Tensor:
    """NaN broadcast to x's shape, in x's dtype (the unquantized output's): no storage but
    one element, and any use of its values shows."""
    return x.new_full((), float("nan")).expand(x.shape)


class _Anchor(torch.autograd.Function):
    """The torch path's anchor: a function of the fp32 normed output `out` whose gradient
    is the anchor's (read in x's dtype, as the unquantized op reads its output's)."""

    @staticmethod
    def forward(ctx, out, x_dtype):
        ctx.out_dtype = out.dtype
        return out.new_full((), float("nan"), dtype=x_dtype).expand(out.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.out_dtype), None


# Not a registered custom op yet: torch.compile runs it eagerly, between graphs
@torch.compiler.disable
def quantized_norm_fwd(x: Tensor, residual: Tensor | None, gate: Tensor | None, weight: Tensor | None,
                       bias: Tensor | None, spec: NormSpec, residual_dtype: torch.dtype | None,
                       need_stats: bool, x1: Tensor | None = None, scale: Tensor | None = None):
    """(Quantized, new_residual or None, rstd, mean) with no autograd graph: the kernel
    launch, or the torch path's norm into fp32 (quant_from's dtype when set) and its cast."""
    with torch.no_grad():
        if uses_triton(x):
            return kernels("norm", x).norm_fwd(x, residual, gate, weight, bias, spec, residual_dtype, need_stats, x1,
                                               None, qscale=scale)
        plain = replace(spec, quant=Quant.NONE, out_dtype=spec.quant_from or torch.float32)
        out, new_res, rstd, mean = reference.norm_fwd(x, residual, gate, weight, bias, plain, residual_dtype,
                                                      need_stats, x1)
        return fp8.quantize(out, spec, scale), new_res, rstd, mean


class _KernelNorm(torch.autograd.Function):
    """add_norm(quant=...) on the kernel path with a gradient wanted: the quantized launch
    (which also stores the row statistics), and the norm op's own backward."""

    @staticmethod
    def forward(ctx, op: FusedOp, x, residual, gate, weight, bias, x1, spec: NormSpec, residual_dtype, scale):
        q, new_res, rstd, mean = quantized_norm_fwd(x, residual, gate, weight, bias, spec, residual_dtype, True, x1,
                                                    scale)
        ctx.op = op
        inputs = (x, residual, gate, weight, bias, spec.unquantized().pack(), residual_dtype, True, x1, None)
        constant = op.setup(ctx, inputs, (None, new_res, rstd, mean)) or ()
        if new_res is not None and 1 in constant:
            ctx.mark_non_differentiable(new_res)
        ctx.set_materialize_grads(False)
        return _anchor_of(x), new_res, q

    @staticmethod
    def backward(ctx, d_anchor, d_new_res, _):
        op = ctx.op
        if torch.is_grad_enabled():  # create_graph=True: the op's differentiable backward
            dx, dres, dgate, dw, db, *_, dx1 = op.graph_grads(ctx, (d_anchor, d_new_res))
        else:
            dx, dres, dgate, dw, db, *_, dx1 = op.grads(ctx, (d_anchor, d_new_res), op.bwd)
        return None, dx, dres, dgate, dw, db, dx1, None, None, None


@torch.compiler.disable
def quantized_norm(op: FusedOp, x: Tensor, residual: Tensor | None, gate: Tensor | None, weight: Tensor | None,
                   bias: Tensor | None, spec: NormSpec, residual_dtype: torch.dtype | None, x1: Tensor | None,
                   scale: Tensor | None):
    """add_norm's (Quantized, new_residual or None) on validated arguments; op: the norm's
    FusedOp, whose backward serves the kernel path. With a gradient wanted the Quantized
    has its anchor."""
    if spec.dropout_p > 0:
        raise ValueError("quant= does not take add_norm's dropout (dropout_p must be 0)")
    if not _wants_grad(x, residual, gate, weight, bias, x1):
        return quantized_norm_fwd(x, residual, gate, weight, bias, spec, residual_dtype, False, x1, scale)[:2]
    if uses_triton(x) and not func_transforms_active():
        anchor, new_res, q = _KernelNorm.apply(op, x, residual, gate, weight, bias, x1, spec, residual_dtype, scale)
        return q._replace(anchor=anchor), new_res
    out, new_res, _, _ = reference.norm_fwd(x, residual, gate, weight, bias,
                                            replace(spec.unquantized(), out_dtype=torch.float32), residual_dtype,
                                            False, x1)
    return _quantize_with_anchor(out, spec, scale, x.dtype), new_res


def _quantize_with_anchor(out: Tensor, spec: NormSpec, scale: Tensor | None, x_dtype: torch.dtype) -> fp8.Quantized:
    """The torch path: the fp32 output (with its graph) quantized as the no-grad call does
    it (rounded to quant_from first, when set), and its anchor."""
    src = out.detach() if spec.quant_from is None else out.detach().to(spec.quant_from)
    return fp8.quantize(src, spec, scale)._replace(anchor=_Anchor.apply(out, x_dtype))


@torch.compiler.disable
def quantized_norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias, bspec: NormSpec, spec: NormSpec,
                           alpha: float, residual_dtype: torch.dtype, scale: Tensor | None = None,
                           need_stats: bool = False):
    """norm_add_norm's (new_residual, Quantized, rstd_b, mean_b, rstd, mean) with no autograd
    graph: the second norm's output quantized by the kernel's launch, or on the torch path
    its fp32 output cast (no statistics there)."""
    with torch.no_grad():
        if uses_triton(x):
            return kernels("norm_add", x).norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias, bspec,
                                                       spec, alpha, residual_dtype, True, need_stats, scale)
        plain = replace(spec, quant=Quant.NONE, out_dtype=spec.quant_from or torch.float32)
        new_res, out = reference.norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias, bspec, plain,
                                              alpha, residual_dtype, True)
        return new_res, fp8.quantize(out, spec, scale), None, None, None, None


class _KernelNormAdd(torch.autograd.Function):
    """norm_add_norm(quant=...) on the kernel path with a gradient wanted, as _KernelNorm."""

    @staticmethod
    def forward(ctx, op: FusedOp, x, residual, branch_weight, branch_bias, weight, bias, bspec, spec, alpha,
                residual_dtype, scale):
        new_res, q, *stats = quantized_norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias, bspec,
                                                    spec, alpha, residual_dtype, scale, True)
        ctx.op = op
        packed = [*bspec.pack(), *spec.unquantized().pack(), alpha]
        op.setup(ctx, (x, residual, branch_weight, branch_bias, weight, bias, packed, residual_dtype, True, True),
                 (new_res, None, *stats))
        ctx.set_materialize_grads(False)
        return _anchor_of(x), new_res, q

    @staticmethod
    def backward(ctx, d_anchor, d_new_res, _):
        op = ctx.op
        grads = (d_new_res, d_anchor)
        found = op.graph_grads(ctx, grads) if torch.is_grad_enabled() else op.grads(ctx, grads, op.bwd)
        return (None, *found, None, None, None, None, None)


@torch.compiler.disable
def quantized_norm_add(op: FusedOp, x, residual, branch_weight, branch_bias, weight, bias, bspec: NormSpec,
                       spec: NormSpec, alpha: float, residual_dtype: torch.dtype, scale: Tensor | None):
    """norm_add_norm's (Quantized, new_residual) on validated arguments (op: its FusedOp)."""
    if not _wants_grad(x, residual, branch_weight, branch_bias, weight, bias):
        new_res, q, *_ = quantized_norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias, bspec, spec,
                                                alpha, residual_dtype, scale)
        return q, new_res
    if uses_triton(x) and not func_transforms_active():
        anchor, new_res, q = _KernelNormAdd.apply(op, x, residual, branch_weight, branch_bias, weight, bias, bspec,
                                                  spec, alpha, residual_dtype, scale)
        return q._replace(anchor=anchor), new_res
    new_res, out = reference.norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias, bspec,
                                          replace(spec.unquantized(), out_dtype=torch.float32), alpha, residual_dtype,
                                          True)
    return _quantize_with_anchor(out, spec, scale, x.dtype), new_res
