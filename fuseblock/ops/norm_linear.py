"""`norm_linear`: a norm and the Linear that consumes it, as one autograd node.

    new_residual = x + residual,   y = Linear(norm(new_residual))

Unfused, the norm's output lives until backward because the Linear saves its input for
its weight gradient. Here only p (the stored new_residual, or x), the row statistics
(rstd, and mean for a layer norm) and the weights are saved; backward rebuilds the
normalized output from them in one elementwise pass over p, then forms the Linear's
dW = dy^T out and the norm's gradient from dout = dy W. That saves one activation of
the norm's width per norm + Linear pair, for one extra read of p in backward.

Dispatch as `fuseblock.ops.norm`'s: the Triton kernels (the norm op's launchers, or its
registered custom ops while torch.compile traces), else the torch path (the reference's
norm with its statistics and `reference.norm_grads`); under a torch.func transform the
plain composition.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import Tensor

from ..reference import fp8
from ..reference import norm as reference
from ..spec import (
    DEFAULT_GATE_ACT,
    DEFAULT_GATE_POSITION,
    MX_BLOCK,
    Fp8Recipe,
    NormSpec,
    Quant,
    new_residual_dtype,
    residual_grad_dtype,
)
from . import dtensor
from .checks import check_float_dtype, check_tensor, linear_recipe, refuse_keywords, resolve
from .dispatch import func_transforms_active, kernels, uses_triton
from .norm import add_norm, apply_norm, norm_op


def _kernel_out(p: Tensor, weight, bias, spec: NormSpec) -> Tensor:
    """The norm's output rebuilt by the forward kernel on p: one launch that reads p and
    writes out (the statistics are recomputed in registers, which costs no traffic), and
    the same rounding as the forward's output. The registered op while torch.compile
    traces (opaque to it, with a fake), else the launcher itself (no dispatcher cost)."""
    if torch.compiler.is_compiling():
        return norm_op.fwd_op(p, None, None, weight, bias, spec.pack(), None, False)[0]
    return kernels("norm", p).norm_fwd(p, None, None, weight, bias, spec, None, False)[0]


def _kernel_norm_grads(dout, dres, p, weight, bias, rstd, mean, spec: NormSpec, x_dtype, rgrad_dtype):
    """(dx, dresidual or None, dweight, dbias) from the Triton backward."""
    if torch.compiler.is_compiling():
        dx, dr, _, dw, db, *_ = norm_op.bwd_op(dout, dres, p, None, weight, bias, rstd, mean, spec.pack(), x_dtype,
                                              rgrad_dtype)
    else:
        dx, dr, _, dw, db, *_ = kernels("norm", p).norm_bwd(dout, dres, p, None, weight, bias, rstd, mean, spec,
                                                           x_dtype, rgrad_dtype)
    return dx, (dr if rgrad_dtype is not None else None), dw, db


def _fp8_forward(x, residual, norm_weight, norm_bias, weight, bias, spec: NormSpec, residual_dtype):
    """y of the fp8 recipe: the normed rows quantized by the norm's own launch (kernel
    path; the torch path casts its fp32 output) and the weight along its own rows (the
    shared axis k), then y in x's dtype and the bias added after it. fp8_row (torchao's
    Float8Linear "rowwise"): a scale per row of each, one torch._scaled_mm. mxfp8: blocks
    of 32 along k with e8m0 scales, `fuseblock.reference.fp8.mx_linear` (torch._scaled_mm with block
    scales where the device takes them, else dequantize-and-matmul in fp32).
    Returns (y, new_residual, rstd, mean, native)."""
    native = False
    if spec.quant != Quant.MX:
        problem = fp8.rowwise_mm_problem(x.device, x.dtype, fp8.fp8_dtype(spec))
        if problem is not None:
            raise ValueError(f"norm_linear(quant='fp8_row'): {problem}")
    if uses_triton(x):
        # here, not at the top: ops/fp8.py's torch.compiler.disable imports torch._dynamo
        from .fp8 import quantized_norm_fwd
        q, new_res, rstd, mean = quantized_norm_fwd(x, residual, None, norm_weight, norm_bias, spec, residual_dtype,
                                                    True)
    else:
        plain = replace(spec, quant=Quant.NONE, out_dtype=spec.quant_from or torch.float32)
        out, new_res, rstd, mean, native = reference.norm_and_stats(x, residual, norm_weight, norm_bias, plain,
                                                                    residual_dtype)
        q = fp8.quantize(out, spec)
    w = fp8.quantize(weight, replace(spec, quant_from=None, scale_ub=0.0))
    d = x.shape[-1]
    if spec.quant == Quant.MX:
        rows = fp8.Quantized(q.data.reshape(-1, d), q.scale.reshape(-1, d // MX_BLOCK))
        y = fp8.mx_linear(rows, w, x.dtype)
    else:
        y = torch._scaled_mm(q.data.reshape(-1, d), w.data.t(), scale_a=q.scale.reshape(-1, 1),
                             scale_b=w.scale.reshape(1, -1), out_dtype=x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0]), new_res, rstd, mean, native


class _NormLinear(torch.autograd.Function):
    """Inputs (x, residual, norm_weight, norm_bias, weight, bias, spec, residual_dtype, rows);
    outputs (y, new_residual or None). residual_dtype None: no residual is stored, and
    p is x itself (the caller returns x as new_residual, so autograd routes its gradient).

    rows (fuseblock.ops.dtensor's sequence parallelism, else None): the Linear reads other
    ranks' rows too. `rows.gather` all-gathers the normalized rows before the Linear, in
    forward and again in backward for the weight's gradient, so that only this rank's p is
    kept; `rows.scatter` reduce-scatters the gradient at them back to this rank's rows."""

    @staticmethod
    def forward(ctx, x, residual, norm_weight, norm_bias, weight, bias, spec: NormSpec, residual_dtype, rows=None):
        ctx.kernel, ctx.native = uses_triton(x), False
        with torch.no_grad():  # the statistics are wanted here, not a graph of the norm
            if spec.quant != Quant.NONE:  # the fp8 recipe's forward; backward is the same as unquantized
                y, new_res, rstd, mean, ctx.native = _fp8_forward(x, residual, norm_weight, norm_bias, weight, bias,
                                                                  spec, residual_dtype)
                out = None
            elif ctx.kernel:
                out, new_res, rstd, mean = apply_norm(x, residual, None, norm_weight, norm_bias, spec, residual_dtype,
                                                      need_stats=True)
            else:
                out, new_res, rstd, mean, ctx.native = reference.norm_and_stats(x, residual, norm_weight, norm_bias,
                                                                                spec, residual_dtype)
            if out is not None:
                y = F.linear(out if rows is None else rows.gather(out), weight, bias)
        del out  # the point of the op: nothing keeps the normalized rows alive past here
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(new_res if residual_dtype is not None else x, norm_weight, norm_bias, weight, rstd,
                              mean if spec.center else None)
        ctx.spec, ctx.rows = spec.unquantized(), rows  # backward: the unquantized norm's
        ctx.x_dtype, ctx.y_dtype = x.dtype, y.dtype  # y's differs under autocast, which lowers the Linear
        ctx.out_dtype = spec.out_dtype_for(x.dtype)  # the norm's output's, the Linear's input's
        ctx.residual_dtype = None if residual is None else residual.dtype
        ctx.stored = residual_dtype is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y, new_res

    @staticmethod
    def backward(ctx, dy, dnew_res):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fuseblock.norm_linear does not support double backward (create_graph=True): its backward "
                "rebuilds the normalized output from saved statistics. Use the unfused norm and nn.Linear there.")
        p, nw, nb, weight, rstd, mean = ctx.saved_tensors
        spec, needs = ctx.spec, ctx.needs_input_grad
        d, n_out = p.shape[-1], weight.shape[0]
        p2, rows = p.reshape(-1, d), ctx.rows
        m = p2.shape[0] if rows is None else rows.gathered(p2.shape[0])  # the Linear's rows
        dy2 = dy.reshape(-1, n_out) if dy is not None else p2.new_zeros((m, n_out), dtype=ctx.y_dtype)
        dres = dnew_res.reshape(-1, d) if ctx.stored and dnew_res is not None else None
        need_norm = any(needs[:4])
        # The Linear's gradients in y's dtype, cast back to the parameters' and x's, as
        # autograd does through autocast's casts (all no-ops without autocast).
        lin = ctx.y_dtype
        dx = dresidual = dnw = dnb = None
        rgrad_dtype = residual_grad_dtype(ctx.x_dtype, ctx.residual_dtype)
        # the torch path's rebuilt r = q * rstd: the one extra elementwise pass over p
        r = None if ctx.kernel or not (needs[4] or (need_norm and not ctx.native)) \
            else reference.normalized(p2, rstd, mean, spec)
        if need_norm:
            dout = dy2.mm(weight.to(lin)).to(ctx.out_dtype)  # (M, d), the gradient at the norm's output
            if rows is not None:
                dout = rows.scatter(dout)
            if ctx.kernel:
                dx, dr, dnw, dnb = _kernel_norm_grads(dout, dres, p2, nw, nb, rstd, mean, spec, ctx.x_dtype,
                                                      rgrad_dtype)
            else:
                dp, dnw, dnb = reference.norm_grads(dout, p2, r, rstd, mean, nw, nb, spec, ctx.native,
                                                    nw is not None and needs[2], nb is not None and needs[3])
                if dres is not None:
                    dp = dp + dres.to(dp.dtype)
                dx = dp.to(ctx.x_dtype)
                dr = None if rgrad_dtype is None else dp.to(rgrad_dtype)
            dx = dx.reshape(p.shape)
            dresidual = None if ctx.residual_dtype is None else (dx if rgrad_dtype is None else dr.reshape(p.shape))
        dweight = None
        if needs[4]:  # the Linear's input, rebuilt (the kernel path: one launch on p; torch: r, in place)
            out = _kernel_out(p2, nw, nb, spec) if ctx.kernel else reference.affine_(r, spec, nw, nb)
            if rows is not None:
                out = rows.gather(out)
            dweight = dy2.t().mm(out.to(ctx.out_dtype).to(lin)).to(weight.dtype)  # rounded as the forward's was
        return (
            dx, dresidual,
            dnw.to(nw.dtype) if nw is not None and needs[2] else None,
            dnb.to(nb.dtype) if nb is not None and needs[3] else None,
            dweight, dy2.sum(0).to(ctx.bias_dtype) if needs[5] else None, None, None, None,
        )


def _check_linear(x: Tensor, weight, bias, out_dtype) -> None:
    check_tensor("weight", weight, x)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must have shape (out_features, {x.shape[-1]}), got {tuple(weight.shape)}")
    # The Linear runs on the norm's output, which has x's dtype (or out_dtype); autocast casts both.
    if out_dtype is not None and weight.dtype != out_dtype:
        raise TypeError(f"out_dtype is the Linear's input dtype: weight must have it ({out_dtype}), got "
                        f"{weight.dtype}")
    if weight.dtype != x.dtype and out_dtype is None and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"weight must have x's dtype {x.dtype} (or pass out_dtype=weight.dtype), got {weight.dtype}")
    if bias is not None:
        check_tensor("bias", bias, x)
        if tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype:
            raise ValueError(f"bias must be a ({weight.shape[0]},) tensor of weight's dtype, got "
                             f"{tuple(bias.shape)} {bias.dtype}")


def norm_linear(
    x: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor | None,
    norm_bias: Tensor | None,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    kind: str = "rms",
    eps: float | None = None,
    weight_offset: float = 0.0,
    residual_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    quant: str | Fp8Recipe | None = None,
    **removed: NoReturn,  # none: the former fp8 keywords, refused naming the recipe (refuse_keywords)
) -> tuple[Tensor, Tensor]:
    """`y = F.linear(norm(x + residual), weight, bias)`: returns (y, new_residual).

    The norm is `fuseblock.add_norm(x, residual, norm_weight, norm_bias, kind=kind,
    eps=eps, weight_offset=weight_offset, residual_dtype=residual_dtype)` (same
    defaults: new_residual in torch.promote_types(x, residual), x itself when residual
    is None). Its output is not kept for backward: only p, the row statistics and the
    weights are, and backward rebuilds the output in one elementwise pass. Double
    backward is refused.

    out_dtype: the dtype the norm's output (the Linear's input) is stored in, written by
    the norm's kernel from fp32 (None: x's); weight and bias must have it. The gradient at
    the norm's output is formed in it, as the unfused add_norm(out_dtype=) + F.linear's.

    quant="fp8_row" (torchao's rowwise recipe) or "mxfp8" (blocks of 32 along the
    features, e8m0 scales), or a `fuseblock.Fp8Recipe` of either mode (its fp8_dtype,
    mx_rounding "floor" or "rceil", scale_ub): docs/low_precision.md. The norm writes its
    rows as fp8 codes and scales in its one launch (fp8_row's amax bounded by scale_ub
    when given), the weight is quantized along its own rows, and
    torch._scaled_mm forms y (mxfp8 where the device takes block scales; elsewhere the
    dequantize-and-matmul fallback of `fuseblock.reference.fp8.mx_linear`). The backward is the
    unquantized one, in high precision: dout = dy W and dW = dy^T out with out rebuilt from
    p, so dx, dresidual and the norm's gradients equal those of norm_linear without quant
    for the same dy.
    """
    if removed:
        refuse_keywords("norm_linear", removed)
    check_tensor("x", x)
    if quant is not None:
        quant = linear_recipe(quant)
        if dtensor.has_dtensor(x, residual, norm_weight, norm_bias, weight, bias) or func_transforms_active():
            raise ValueError(f"norm_linear(quant={quant.mode!r}) takes plain tensors, outside torch.func transforms")
        if isinstance(weight, Tensor) and weight.dtype != x.dtype:
            raise TypeError(f"quant={quant.mode!r} needs weight in x's dtype {x.dtype}, got {weight.dtype}")
    if dtensor.has_dtensor(x, residual, norm_weight, norm_bias, weight, bias):  # docs/parallel.md
        if out_dtype is not None:
            raise ValueError("norm_linear's out_dtype does not take DTensor inputs yet")
        return dtensor.norm_linear(_norm_linear, add_norm, x, residual, norm_weight, norm_bias, weight, bias,
                                   kind=kind, eps=eps, weight_offset=weight_offset, residual_dtype=residual_dtype)
    return _norm_linear(x, residual, norm_weight, norm_bias, weight, bias, kind=kind, eps=eps,
                        weight_offset=weight_offset, residual_dtype=residual_dtype, out_dtype=out_dtype,
                        quant=quant)


def _norm_linear(x, residual, norm_weight, norm_bias, weight, bias, *, kind, eps, weight_offset, residual_dtype,
                 rows=None, out_dtype=None, quant: Fp8Recipe | None = None):
    """norm_linear on plain tensors (a DTensor call's local shards; rows: _NormLinear's)."""
    check_float_dtype("out_dtype", out_dtype)  # before the weight's dtype is compared with it
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalized last dim)")
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if t is not None:
            check_tensor(name, t, x)
            if tuple(t.shape) != (x.shape[-1],):
                raise ValueError(f"{name} must have shape ({x.shape[-1]},), got {tuple(t.shape)}")
    _check_linear(x, weight, bias, out_dtype)
    spec = resolve(x, residual, norm_weight, norm_bias, None, kind=kind, c=None, eps=eps, gate_act=DEFAULT_GATE_ACT,
                   gate_position=DEFAULT_GATE_POSITION, num_groups=1, residual_dtype=residual_dtype,
                   weight_offset=weight_offset, out_dtype=out_dtype, quant=quant)
    rdtype = new_residual_dtype(x.dtype, None if residual is None else residual.dtype, residual_dtype)
    if func_transforms_active():  # vmap, grad, jvp: the plain composition, which they see through
        if rows is not None:
            raise ValueError("norm_linear on sequence-sharded DTensors is not supported under torch.func transforms")
        out, new_res, _, _ = reference.norm_fwd(x, residual, None, norm_weight, norm_bias, spec, rdtype, False)
        return F.linear(out, weight, bias), (x if rdtype is None else new_res)
    y, new_res = _NormLinear.apply(x, residual, norm_weight, norm_bias, weight, bias, spec, rdtype, rows)
    return y, (x if rdtype is None else new_res)
