"""`norm` and `add_norm`: validation, dispatch, autograd and custom-op registration.

Dispatch is `fuseblock.ops.dispatch`'s, decided per call before anything is registered:
- the Triton kernels: forward and backward registered by `fuseblock.ops.registry.FusedOp`
  as custom ops that torch.compile traces whole, and an eager autograd.Function over the
  same launchers;
- the torch path (`fuseblock.reference`): plain differentiable torch ops, the same the
  naive form runs, so autograd, torch.func and Inductor see the math itself.
"""
from __future__ import annotations

import math
from typing import List, NoReturn, Optional

import torch
from torch import Tensor
from torch.compiler import is_compiling
from torch.utils.checkpoint import CheckpointError

from ..reference import norm as reference
from ..spec import (
    DEFAULT_GATE_ACT,
    DEFAULT_GATE_POSITION,
    Fp8Recipe,
    NormSpec,
    Quant,
    acc_dtype,
    new_residual_dtype,
    residual_grad_dtype,
    stored_dtype,
)
from ..triton_support import TRACING
from . import dispatch, dtensor
from .checks import (
    check_branch,
    check_scales,
    default_eps,
    refuse_keywords,
    refuse_positional,
    resolve,
)
from .dispatch import func_transforms_active, kernels, kernels_take_cpu, uses_triton
from .registry import FusedOp, live, placeholder, placeholders
from .seed import draw_seed


def _launch_fwd(x, residual, gate, weight, bias, spec, residual_dtype, need_stats, x1=None, seed=None,
                residual_scale=None, branch_scale=None):
    """`_fwd` with None for each absent output: what the eager Function runs. spec: a
    NormSpec (the eager calls), or packed (the custom op's)."""
    if spec.__class__ is not NormSpec:
        spec = NormSpec.unpack(spec)
    try:
        launchers = dispatch.LOADED["norm"]
    except KeyError:
        launchers = kernels("norm", x)
    return launchers.norm_fwd(x, residual, gate, weight, bias, spec, residual_dtype, need_stats, x1,
                              seed if seed is None else _seed_arg(seed), rscale=residual_scale, bscale=branch_scale)


# The spec crosses the custom-op boundary packed (NormSpec.pack: a list of floats). typing.List,
# not list: torch 2.5's schema inference knows only the typing forms, spelled out.
# x1, seed and the [d] scales (add_norm's branch, `fuseblock.kernels.norm.norm_fwd`) come
# last, with defaults: the plain op's callers pass none.
def _fwd(
    x: Tensor, residual: Optional[Tensor], gate: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
    spec: List[float], residual_dtype: Optional[torch.dtype], need_stats: bool,  # noqa: UP006
    x1: Optional[Tensor] = None, seed: Optional[Tensor] = None, residual_scale: Optional[Tensor] = None,
    branch_scale: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return placeholders(x, _launch_fwd(x, residual, gate, weight, bias, spec, residual_dtype, need_stats, x1, seed,
                                       residual_scale, branch_scale))


def _seed_arg(seed: Optional[Tensor]):
    """The dropout key as the launchers take it: a host seed (in CPU memory) as an int,
    read here at no cost; a device one (drawn while a CUDA graph was captured, or by
    compiled code) as the tensor, which the kernel reads, and so any seed while a
    triton_op is traced (its fake tensors have no value: `fuseblock.ops.seed`)."""
    return int(seed) if seed is not None and seed.is_cpu and not TRACING.on else seed


def _fwd_fake(x, residual, gate, weight, bias, spec, residual_dtype, need_stats, x1=None, seed=None,
              residual_scale=None, branch_scale=None):
    s = NormSpec.unpack(spec)
    rows = x.numel() // x.shape[-1]
    stat = acc_dtype(x.dtype)
    return (
        x.new_empty(x.shape, dtype=s.out_dtype_for(x.dtype)),
        x.new_empty(x.shape, dtype=residual_dtype) if residual_dtype is not None else placeholder(x),
        x.new_empty((rows, s.groups), dtype=stat) if need_stats else placeholder(x),
        x.new_empty((rows, s.groups), dtype=stat) if need_stats and s.center else placeholder(x),
    )


def _bwd(
    dout: Tensor, dres: Optional[Tensor], p: Tensor, gate: Optional[Tensor], weight: Optional[Tensor],
    bias: Optional[Tensor], rstd: Tensor, mean: Optional[Tensor], spec: List[float],  # noqa: UP006
    x_dtype: torch.dtype, residual_grad_dtype: Optional[torch.dtype], seed: Optional[Tensor] = None,
    has_x1: bool = False, residual: Optional[Tensor] = None, x: Optional[Tensor] = None,
    x1: Optional[Tensor] = None, residual_scale: Optional[Tensor] = None, branch_scale: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return placeholders(p, _launch_bwd(dout, dres, p, gate, weight, bias, rstd, mean, spec, x_dtype,
                                       residual_grad_dtype, seed, has_x1, residual, x, x1, residual_scale,
                                       branch_scale))


def _launch_bwd(dout, dres, p, gate, weight, bias, rstd, mean, spec, x_dtype, residual_grad_dtype, seed=None,
                has_x1=False, residual=None, x=None, x1=None, residual_scale=None, branch_scale=None):
    """`_bwd` with None for each absent gradient: what the eager Function runs (spec as
    `_launch_fwd` takes it)."""
    if spec.__class__ is not NormSpec:
        spec = NormSpec.unpack(spec)
    try:
        launchers = dispatch.LOADED["norm"]
    except KeyError:
        launchers = kernels("norm", p)
    return launchers.norm_bwd(dout, dres, p, gate, weight, bias, rstd, mean, spec, x_dtype,
                              residual_grad_dtype, seed if seed is None else _seed_arg(seed), has_x1,
                              residual, x, x1, residual_scale, branch_scale)


def _bwd_fake(dout, dres, p, gate, weight, bias, rstd, mean, spec, x_dtype, residual_grad_dtype, seed=None,
              has_x1=False, residual=None, x=None, x1=None, residual_scale=None, branch_scale=None):
    d = p.shape[-1]
    return (
        p.new_empty(p.shape, dtype=x_dtype),
        p.new_empty(p.shape, dtype=residual_grad_dtype) if residual_grad_dtype is not None else placeholder(p),
        p.new_empty(p.shape, dtype=gate.dtype) if gate is not None else placeholder(p),
        p.new_empty((d,), dtype=weight.dtype) if weight is not None else placeholder(p),
        p.new_empty((d,), dtype=bias.dtype) if bias is not None else placeholder(p),
        p.new_empty(p.shape, dtype=x_dtype) if has_x1 and NormSpec.unpack(spec).dropout_p > 0 else placeholder(p),
        *(p.new_empty((d,), dtype=t.dtype) if t is not None else placeholder(p)
          for t in (residual_scale, branch_scale)),
    )




def _setup(ctx, inputs, output):
    x, residual, gate, weight, bias, spec, residual_dtype, _, x1, seed, *scales = inputs
    rscale, bscale = scales or (None, None)  # the [d] scales, which a plain call does not pass
    _, new_res, rstd, mean = output
    ctx.spec = spec if spec.__class__ is NormSpec else NormSpec.unpack(spec)
    # Backward re-derives everything from p and the row statistics, so the normalized
    # output is never kept: p is the stored new_residual, or x itself when none is stored.
    # Of the branch only the seed is kept (one int64): the dropout masks are regenerated.
    p = new_res if residual_dtype is not None else x
    # A [d] scale's gradient is a column sum of dp times what it scaled: the residual's (a),
    # the branch's (b: x and x1, whose dropout masks are regenerated), kept for it alone
    ctx.save_for_backward(p, gate, weight, bias, rstd, mean if ctx.spec.center else None, seed,
                          residual if rscale is not None else None, x if bscale is not None else None,
                          x1 if bscale is not None else None, rscale, bscale)
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.stored = residual_dtype is not None
    ctx.has_x1 = x1 is not None
    # dx = alpha * keep_x / (1 - dropout_p) * dp is not dresidual = residual_scale * dp (x1
    # alone changes nothing there)
    ctx.scaled = (ctx.spec.alpha != 1.0 or ctx.spec.dropout_p > 0 or ctx.spec.residual_scale != 1.0
                  or rscale is not None or bscale is not None)
    # the dtype of a dresidual written apart from dx: with alpha != 1 or dropout, whenever there
    # is a residual (dx = alpha * keep / (1 - p) * dp is another tensor than dp); else where
    # the residual's dtype differs from x's
    ctx.rgrad_dtype = (ctx.residual_dtype if ctx.scaled else None if ctx.residual_dtype is ctx.x_dtype
                       else residual_grad_dtype(ctx.x_dtype, ctx.residual_dtype))  # (x's dtype: none, no call)
    if ctx.stored and not (x.requires_grad or (residual is not None and residual.requires_grad)
                           or (x1 is not None and x1.requires_grad)):  # written out: on every call
        return (1,)  # new_residual = x + residual needs no gradient when neither does, as in torch
    return ()


def _grads(ctx, grad_outputs, norm_bwd):
    """(dx, dresidual, dgate, dweight, dbias, None x 3, dx1, None, dresidual_scale,
    dbranch_scale) from the saved context: the gradients of the op's inputs, the options'
    None between them."""
    dout, dnew_res = grad_outputs[:2]
    p, gate, weight, bias, rstd, mean, seed, residual, x, x1, rscale, bscale = ctx.saved_tensors
    # absent statistics: None (the eager forward's) or a 1-d placeholder (the custom op's; they are (rows, groups))
    if (rstd is None or rstd.ndim == 1) and p.numel() > 0:
        raise RuntimeError("fuseblock: backward through a norm whose forward ran without grad enabled")
    if dout is None:
        dout = torch.zeros(p.shape, dtype=ctx.spec.out_dtype_for(ctx.x_dtype), device=p.device)
    dres = dnew_res if ctx.stored else None  # else new_residual is x: autograd routes it
    rgrad_dtype = ctx.rgrad_dtype
    if norm_bwd is _launch_bwd and seed is None and "norm" in dispatch.LOADED:  # eager: the launcher itself
        dx, dres_sep, dgate, dw, db, dx1, drs, dbs = dispatch.LOADED["norm"].norm_bwd(
            dout, dres, p, gate, weight, bias, rstd, mean, ctx.spec, ctx.x_dtype, rgrad_dtype, None, ctx.has_x1,
            residual, x, x1, rscale, bscale)
    else:
        dx, dres_sep, dgate, dw, db, dx1, drs, dbs = norm_bwd(  # the eager launcher takes the spec as it is
            dout, dres, p, gate, weight, bias, rstd, mean, ctx.spec if norm_bwd is _launch_bwd else ctx.spec.pack(),
            ctx.x_dtype, rgrad_dtype, seed, ctx.has_x1, residual, x, x1, rscale, bscale,
        )
    grads = (
        dx,
        None if ctx.residual_dtype is None else (dx if rgrad_dtype is None else dres_sep),
        dgate if gate is not None else None,
        dw if weight is not None else None,  # in the weight's and bias's dtypes already: no cast launched
        db if bias is not None else None,
        None, None, None,
        (dx1 if ctx.spec.dropout_p > 0 else dx) if ctx.has_x1 else None,  # no dropout: dx1 = dx
    )
    # the [d] scales' after the seed's None, where the call had them (dx1 stays last otherwise)
    return grads if rscale is None and bscale is None else (*grads, None, drs, dbs)


def _dropout_scales(ctx, p: Tensor, seed: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """keep / (1 - dropout_p) of x and of x1, as fp32 tensors of p's shape, regenerated
    from the forward's seed by the forward kernel itself (new_residual of x = 1, x1 = 0,
    and of x = 0, x1 = 1): for the double backward only, which needs them as tensors."""
    spec = ctx.spec.with_branch(1.0, ctx.spec.dropout_p)
    one, zero = torch.ones(p.shape, device=p.device), torch.zeros(p.shape, device=p.device)
    launch, key = kernels("norm", p).norm_fwd, _seed_arg(seed)
    sx = launch(one, None, None, None, None, spec, torch.float32, False, zero if ctx.has_x1 else None, key)[1]
    sx1 = launch(zero, None, None, None, None, spec, torch.float32, False, one, key)[1] if ctx.has_x1 else None
    return sx, sx1


def _graph_grads(ctx, grad_outputs):
    """(dx, dresidual, dgate, dweight, dbias) as differentiable torch ops, for
    create_graph=True: out is rebuilt from the saved p by the reference's composition
    (any backend: the kernels' gradients are not differentiable) and autograd takes its
    gradient with a graph, so second derivatives are right. A stored p is this node's own
    output: the second derivative reaches x and residual through it."""
    dout, dnew_res = grad_outputs[:2]
    p, gate, weight, bias, _, _, seed, residual, x, x1, rscale, bscale = ctx.saved_tensors
    leaves = [t for t in (p, gate, weight, bias) if t is not None and t.requires_grad]
    found = {}
    if leaves and dout is not None:
        out = reference.norm_out(p.to(acc_dtype(p.dtype)), gate, weight, bias, ctx.spec)[0]
        out = out.to(ctx.spec.out_dtype_for(ctx.x_dtype))
        got = torch.autograd.grad(out, leaves, dout, create_graph=True, allow_unused=True)
        found = dict(zip(map(id, leaves), got, strict=True))
    dp = found.get(id(p))
    dres = dnew_res if ctx.stored else None
    if dres is not None:
        dp = dres if dp is None else dp + dres
    if dp is None and p.requires_grad:
        dp = torch.zeros(p.shape, dtype=ctx.x_dtype, device=p.device)
    dx = dx1 = None if dp is None else dp.to(ctx.x_dtype)
    drs = dbs = None
    if dp is not None and ctx.scaled:  # dx = b * keep_x / (1 - dropout_p) * dp, and dx1 likewise
        b = ctx.spec.alpha if bscale is None else bscale.to(dp.dtype)
        dx = dx1 = dp * b
        sx = sx1 = None
        if ctx.spec.dropout_p > 0:
            sx, sx1 = _dropout_scales(ctx, p, seed)
            dx, dx1 = dx * sx, (dx1 * sx1 if ctx.has_x1 else None)
        dx, dx1 = dx.to(ctx.x_dtype), (dx1.to(ctx.x_dtype) if ctx.has_x1 else None)
        rows = dp.reshape(-1, dp.shape[-1])
        if rscale is not None:  # d a = sum over rows of dp * r
            drs = (rows * residual.reshape(rows.shape).to(dp.dtype)).sum(0).to(rscale.dtype)
        if bscale is not None:  # d b = sum over rows of dp * (drop(x) + drop(x1))
            u = x.to(dp.dtype) if sx is None else x.to(dp.dtype) * sx
            if x1 is not None:
                u = u + (x1.to(dp.dtype) if sx1 is None else x1.to(dp.dtype) * sx1)
            dbs = (rows * u.reshape(rows.shape)).sum(0).to(bscale.dtype)
        a = ctx.spec.residual_scale if rscale is None else rscale.to(dp.dtype)
        dp = dp * a if rscale is not None or a != 1.0 else dp  # dresidual = a * dp
    dresidual = None if ctx.residual_dtype is None or dp is None else dp.to(ctx.residual_dtype)
    grads = (dx, dresidual, found.get(id(gate)), found.get(id(weight)), found.get(id(bias)), None, None, None,
             dx1 if ctx.has_x1 else None)
    return grads if rscale is None and bscale is None else (*grads, None, drs, dbs)


norm_op = FusedOp("norm", _fwd, _fwd_fake, _bwd, _bwd_fake, _setup, _grads, stats=(2, 3), graph_grads=_graph_grads,
                  launch_fwd=_launch_fwd, launch_bwd=_launch_bwd)


def apply_norm(x: Tensor, residual: Optional[Tensor], gate: Optional[Tensor], weight: Optional[Tensor],
               bias: Optional[Tensor], spec: NormSpec, residual_dtype: Optional[torch.dtype], need_stats: bool = False,
               x1: Optional[Tensor] = None, residual_scale: Optional[Tensor] = None,
               branch_scale: Optional[Tensor] = None):
    """The op on validated arguments, for add_norm and the family ops: (out, new_residual,
    rstd, mean), absent ones None or empty; need_stats: the caller wants rstd and mean.
    x1, spec.alpha, spec.dropout_p, spec.residual_scale and the [d] tensors residual_scale,
    branch_scale: add_norm's branch (residual_dtype then given).

    The registered op where the Triton kernels run (it also keeps the statistics for its
    backward when a gradient is needed), else the torch path's plain differentiable ops;
    under a torch.func transform (vmap, grad, jvp) those always, as they are all such a
    transform can see through."""
    if not uses_triton(x) or func_transforms_active():
        return reference.norm_fwd(x, residual, gate, weight, bias, spec, residual_dtype, need_stats, x1,
                                  residual_scale, branch_scale)
    # written out, not a generator over the six: this runs on every kernel-path call
    need_stats = need_stats or (torch.is_grad_enabled() and (
        x.requires_grad or (residual is not None and residual.requires_grad)
        or (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad)
        or (gate is not None and gate.requires_grad) or (x1 is not None and x1.requires_grad)
        or (residual_scale is not None and residual_scale.requires_grad)
        or (branch_scale is not None and branch_scale.requires_grad)))
    seed = draw_seed(x) if spec.dropout_p > 0 else None
    if residual_scale is None and branch_scale is None:
        return norm_op(x, residual, gate, weight, bias, spec.pack(), residual_dtype, need_stats, x1, seed)
    return norm_op(x, residual, gate, weight, bias, spec.pack(), residual_dtype, need_stats, x1, seed, residual_scale,
                   branch_scale)


_F32, _F64 = torch.float32, torch.float64
_STRIDED = torch.strided
_DEFAULT_EPS = {(kind, dt): default_eps(dt, kind) for kind in ("rms", "layer") for dt in (_F32, _F64)}
_ONE_GROUP = 1  # compared by identity: CPython has one int 1, and True is another object
_INF = math.inf
# add_norm's branch defaults, compared by identity: the plain fast lane pays two `is`
NO_SCALE = 1.0
NO_DROPOUT = 0.0
# The classes a fast lane takes (`x.__class__ in PLAIN`: no call): plain tensors and
# parameters; a DTensor or another subclass takes the checked path (ops.norm_add's too).
PLAIN = (Tensor, torch.nn.Parameter)


# add_norm's specs with a branch, by the spec's serial and the branch: one instance each, so
# that a training step's dropout calls reuse the launches laid out for it. Bounded.
_BRANCH_SPECS: dict = {}


def _with_branch(spec: NormSpec, alpha, dropout_p, residual_scale) -> NormSpec:
    """spec.with_branch(alpha, dropout_p, residual_scale) (validated floats), the same instance
    for the same four."""
    key = (spec.serial, alpha.__class__, alpha, dropout_p.__class__, dropout_p, residual_scale)
    found = _BRANCH_SPECS.get(key) if spec.serial is not None else None
    if found is None:
        found = spec.with_branch(alpha, dropout_p, residual_scale)
        if spec.serial is not None and len(_BRANCH_SPECS) < 4096:
            _BRANCH_SPECS[key] = found
    return found


def _plain_call(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], kind: str,
                eps) -> Optional[tuple[Tensor, Tensor]]:
    """add_norm's (out, new_residual) for a plain call on the CPU torch path, or None for
    any other call: an fp32 or fp64 RMS or layer norm, every tensor in x's dtype and the
    residual of x's shape, eps a positive float or None. `x + residual`, then torch's
    norm: the naive form's ops.

    On the eager torch path a small call's cost is its host time, so this checks only what
    torch's ops would let through (a residual broadcast to x, an RMS weight broadcast, a
    dtype they would promote); they themselves refuse every other mistake (devices, the
    layer norm's parameter shapes, x with no dims, a non-tensor), and add_norm then takes
    the checked path, whose checks name the argument."""
    dtype = x.dtype
    if ((dtype is not _F32 and dtype is not _F64) or not x.is_cpu or kernels_take_cpu() or type(kind) is not str
            or x.is_nested):  # torch's rms_norm takes a jagged x: the checked path refuses it
        return None
    shape = x.shape
    if not shape:  # x with no dims: the checked path names it
        return None
    if residual is not None and (residual.dtype is not dtype or residual.shape != shape
                                 or residual.layout is not _STRIDED):  # x + a sparse residual is dense: refuse
        return None
    if eps is not None and (type(eps) is not float or not 0.0 < eps < _INF):
        return None
    d = shape[-1]
    # parameters in another float dtype are supported (cast to p's): the checked path
    if d < 1 or (weight is not None and weight.dtype is not dtype):
        return None
    if kind == "layer":  # layer_norm itself refuses a weight or bias of another shape
        if bias is not None and bias.dtype is not dtype:
            return None
    elif kind != "rms" or bias is not None or (weight is not None and (weight.dim() != 1 or weight.numel() != d)):
        return None
    if eps is None:  # kind is "rms" or "layer" here
        eps = _DEFAULT_EPS[kind, dtype]
    p = x if residual is None else torch.add(x, residual)
    if kind == "layer":
        return torch.layer_norm(p, (d,), weight, bias, eps), p
    return reference.RMS_NORM_BODY(p, (d,), weight, eps)[0], p


# Plain kernel-path calls already validated: their spec, new_residual dtype and launcher,
# by what resolve checked of them (dtypes, devices, shapes against x's, layouts) and the
# options. Bounded, as checks' option specs.
_KERNEL_CALLS: dict = {}


def _kernel_call(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], kind: str,
                 eps) -> Optional[tuple[Tensor, Tensor]]:
    """add_norm's (out, new_residual) for a plain call on the kernel path (no gate, branch,
    quant or other option; plain tensors), or None for the checked path: under a torch.func
    transform, and for what is not hashable. A call is validated once per signature (resolve:
    its errors name the argument), then launched with what that resolved: the forward
    launcher directly where no gradient is needed, else the eager Function."""
    if func_transforms_active() or not x.ndim or (eps is not None and eps.__class__ is not float):
        return None
    key = (kind, eps, x.dtype, x.device, x.shape[-1], x.layout, x.is_nested,
           None if residual is None else (residual.dtype, residual.device, residual.shape == x.shape,
                                          residual.layout, residual.is_nested),
           None if weight is None else (weight.dtype, weight.device, weight.shape, weight.layout, weight.is_nested),
           None if bias is None else (bias.dtype, bias.device, bias.shape, bias.layout, bias.is_nested))
    try:
        found = _KERNEL_CALLS[key]
    except KeyError:
        spec = resolve(x, residual, weight, bias, None, kind=kind, c=None, eps=eps, gate_act=DEFAULT_GATE_ACT,
                       gate_position=DEFAULT_GATE_POSITION, num_groups=1, residual_dtype=None)
        found = None if not uses_triton(x) else (  # None: float64, the torch path
            spec, new_residual_dtype(x.dtype, None if residual is None else residual.dtype, None),
            kernels("norm", x).norm_fwd)
        if len(_KERNEL_CALLS) < 4096:
            _KERNEL_CALLS[key] = found
    except TypeError:  # unhashable: kind (a list, say), which resolve names
        return None
    if found is None:
        return None
    spec, rdtype, launch = found
    residual = None if residual is None else live(residual)
    weight = None if weight is None else live(weight)
    bias = None if bias is None else live(bias)
    x = live(x)
    if torch.is_grad_enabled() and (x.requires_grad or (residual is not None and residual.requires_grad)
                                    or (weight is not None and weight.requires_grad)
                                    or (bias is not None and bias.requires_grad)):
        out, new_res, _, _ = norm_op.eager(None, x, residual, None, weight, bias, spec, rdtype, True, None, None)
    else:
        out, new_res, _, _ = launch(x, residual, None, weight, bias, spec, rdtype, False)
    return out, (x if rdtype is None else new_res)


def add_norm(
    x: Tensor,
    residual: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    *positional: Tensor,  # none: a fifth is refused by name (refuse_positional)
    kind: str = "rms",
    c: Optional[float] = None,
    eps: Optional[float] = None,
    residual_dtype: Optional[torch.dtype] = None,
    gate: Optional[Tensor] = None,
    gate_act: str = DEFAULT_GATE_ACT,
    gate_position: str = DEFAULT_GATE_POSITION,
    num_groups: int = 1,
    weight_offset: float = 0.0,
    alpha: float = NO_SCALE,
    residual_scale: float | Tensor = NO_SCALE,
    branch_scale: float | Tensor | None = None,
    x1: Optional[Tensor] = None,
    dropout_p: float = NO_DROPOUT,
    out_dtype: Optional[torch.dtype] = None,
    quant: Optional[str | Fp8Recipe] = None,
    scale: Optional[Tensor] = None,
    **removed: NoReturn,  # none: the former fp8 keywords, refused naming the recipe (refuse_keywords)
) -> tuple[Tensor, Tensor]:
    """Fused residual add + normalize over the last dim: returns (out, new_residual).

    new_residual = x + residual (x alone when residual is None), stored in
    residual_dtype: by default the dtype torch's `x + residual` has
    (torch.promote_types), so an fp32 residual stream is never rounded to bf16
    activations; x's dtype when residual is None. With p = new_residual and d the size
    of one of `num_groups` groups of the last dim:

        q = p (rms, l2) or p - mean(p) (layer);  sigma = sqrt(q.q/d + eps)
        out = (c/sqrt(d)) * (q/sigma) * (weight_offset + weight) + bias   (c: sqrt(d), or 1 for l2)

    eps=None (the default) is torch's for the kind and p: 1e-5 for kind="layer", as
    F.layer_norm's; for "rms" and "l2" the machine epsilon of p's computation dtype (fp32's
    for fp16, bf16, fp32; fp64's for fp64), as in F.rms_norm(x + residual).
    weight_offset (Gemma's 1 + w) is added to the weight in fp32.

    A gate gives out = N(p * g(gate)) (gate_position="pre") or N(p) * g(gate) ("post"),
    g one of "silu" (alias "swish"), "sigmoid", "identity" (alias "none"). out has x's dtype,
    or out_dtype: the fp32 result stored once in that dtype (an fp32 out of bf16 x is not
    rounded to bf16 first), and the gradient at out read in it.

    The branch: new_residual = residual + alpha * (drop(x) + drop(x1)) (Granite's
    residual_multiplier, parallel attention and MLP branches, branch dropout). alpha a
    finite float; x1 of x's shape and dtype; dropout_p in [0, 1): independent masks for x
    and x1, kept elements scaled by 1/(1 - dropout_p), drawn from torch's default
    generator (torch.manual_seed reproduces a call). Set dropout_p=0 in eval.
    The backward returns dx = alpha * keep_x/(1 - dropout_p) * dp, dx1 likewise, and
    dresidual = dp (dp: the gradient at new_residual).

    Per-channel scales (nGPT, Muse Spark): new_residual = a * residual + b * (drop(x) +
    drop(x1)), a = residual_scale, b = branch_scale, each a finite float or a (d,) tensor
    in fp32 or the weight's dtype (x's without a weight), multiplied along the last dim in
    fp32. alpha is branch_scale's float form: give one of them. A tensor scale's gradient
    is a column sum, sum over rows of dp * residual (a) or dp * (drop(x) + drop(x1)) (b),
    in the scale's dtype, from the backward's own launches; dresidual = a * dp. residual_scale
    needs a residual. Neither takes quant= or DTensor inputs yet.

    quant= (a `fuseblock.Fp8Recipe`, or a mode's name for the recipe with its defaults:
    "fp8_tensor" | "fp8_row" | "mxfp8") returns `Quantized(data, scale)` in place of out,
    written by the norm's own launch (docs/low_precision.md): the recipe's fp8_dtype codes
    with the static scale= tensor (fp8_tensor: the call's data, not a recipe option), a
    scale per row (fp8_row, its amax bounded by the recipe's scale_ub when given) or e8m0
    scales per 32 columns (mxfp8, mx_rounding "floor" or "rceil"). The fp32 normed value
    is cast (one rounding), or first rounded to the recipe's quant_from as an unfused
    norm-then-cast pipeline does. mx_columnwise=True (mxfp8) also returns data_t, scale_t:
    blocks of 32 down the columns, of shape (d, rows) and (d, rows/32), from the same fp32
    values in the same launch. The codes carry no gradient; when an input requires one,
    `Quantized.anchor` takes the gradient at the normed output in high precision, and the
    backward returns the unquantized op's gradients (`fuseblock.Quantized`,
    docs/low_precision.md). scale= given without quant= is refused.
    """
    if positional:
        refuse_positional("add_norm", "x, residual, weight, bias", 4 + len(positional))
    if removed:
        refuse_keywords("add_norm", removed)
    if (quant is None and scale is None  # else resolve validates the recipe's call
            and x1 is None and gate is None and c is None and residual_dtype is None and out_dtype is None
            and alpha is NO_SCALE and dropout_p is NO_DROPOUT and num_groups is _ONE_GROUP
            and residual_scale is NO_SCALE and branch_scale is None
            and type(weight_offset) is float and weight_offset == 0.0
            and gate_act is DEFAULT_GATE_ACT and gate_position is DEFAULT_GATE_POSITION
            and x.__class__ in PLAIN and (residual is None or residual.__class__ in PLAIN)
            and (weight is None or weight.__class__ in PLAIN) and (bias is None or bias.__class__ in PLAIN)
            and not is_compiling()):  # a plain call, of plain tensors (no DTensor): the fast lanes
        if x.is_cuda or dispatch.CPU_KERNELS:
            fast = _kernel_call(x, residual, weight, bias, kind, eps)
            if fast is not None:
                return fast
        else:
            try:
                plain = _plain_call(x, residual, weight, bias, kind, eps)
            except (RuntimeError, AttributeError) as e:  # a mistake torch refused: the checked path below names it
                # Only torch's refusals (a RuntimeError; an AttributeError for a non-tensor):
                # torch's own control flow passes through, such as activation checkpointing's
                # early stop (an Exception) and its CheckpointError (a RuntimeError).
                if isinstance(e, CheckpointError):
                    raise
                plain = None
            if plain is not None:
                return plain
    if dtensor.has_dtensor(x, residual, weight, bias, gate, x1):  # per-rank shards: docs/parallel.md
        if quant is not None or scale is not None:
            raise ValueError("quant= does not take DTensor inputs yet: quantize each rank's local tensor")
        if residual_scale is not NO_SCALE or branch_scale is not None:
            raise ValueError(dtensor.NO_SCALES)
        return dtensor.add_norm(add_norm, x, residual, weight, bias, gate, x1, kind=kind, c=c, eps=eps,
                                residual_dtype=residual_dtype, gate_act=gate_act, gate_position=gate_position,
                                num_groups=num_groups, weight_offset=weight_offset, alpha=alpha,
                                dropout_p=dropout_p, out_dtype=out_dtype)
    no_branch = (x1 is None and alpha is NO_SCALE and dropout_p is NO_DROPOUT and residual_scale is NO_SCALE
                 and branch_scale is None)  # else checked below
    spec = resolve(
        x, residual, weight, bias, gate, kind=kind, c=c, eps=eps, gate_act=gate_act,
        gate_position=gate_position, num_groups=num_groups, residual_dtype=residual_dtype,
        weight_offset=weight_offset, out_dtype=out_dtype,
        quant=quant, scale=scale,
    )
    rdtype = new_residual_dtype(x.dtype, None if residual is None else residual.dtype, residual_dtype)
    rscale = bscale = None
    if not no_branch:
        check_branch(x, x1, alpha, dropout_p)
        alpha, rs, rscale, bscale = check_scales(x, residual, weight, alpha, residual_scale, branch_scale)
        if reference.is_branch(spec.with_branch(alpha, dropout_p, rs), x1, rscale, bscale):
            # new_residual is not x: always stored
            spec = _with_branch(spec, alpha, dropout_p, rs)
            rdtype = stored_dtype(x.dtype, None if residual is None else residual.dtype, residual_dtype)
        if spec.residual_scale != 1.0 or rscale is not None or bscale is not None:
            if spec.quant != Quant.NONE:
                raise ValueError("quant= does not take residual_scale or a tensor branch_scale yet")
            dtensor.refuse_scales(None, None, rscale, bscale)
    if spec.quant != Quant.NONE:
        # here, not at the top: ops/fp8.py's torch.compiler.disable imports torch._dynamo
        from . import fp8 as quant_ops
        out, new_res = quant_ops.quantized_norm(norm_op, x, residual, gate, weight, bias, spec, rdtype, x1, scale)
        return out, (x if rdtype is None else new_res)
    out, new_res, _, _ = apply_norm(x, residual, gate, weight, bias, spec, rdtype, x1=x1, residual_scale=rscale,
                                    branch_scale=bscale)
    return out, (x if rdtype is None else new_res)


def norm(
    x: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    *positional: Tensor,  # none: a fourth is refused by name (refuse_positional)
    kind: str = "rms",
    c: Optional[float] = None,
    eps: Optional[float] = None,
    gate: Optional[Tensor] = None,
    gate_act: str = DEFAULT_GATE_ACT,
    gate_position: str = DEFAULT_GATE_POSITION,
    num_groups: int = 1,
    weight_offset: float = 0.0,
    out_dtype: Optional[torch.dtype] = None,
    quant: Optional[str | Fp8Recipe] = None,
    scale: Optional[Tensor] = None,
    **removed: NoReturn,  # none: the former fp8 keywords, refused naming the recipe (refuse_keywords)
) -> Tensor:
    """Normalize over the last dim: `add_norm` with no residual (see there for the math
    and out_dtype; quant=... returns `Quantized`, as add_norm's).

    kind="rms" equals torch's rms_norm and kind="layer" its layer_norm at the same eps;
    kind="l2" is x / sqrt(x.x + d*eps) * weight + bias.
    """
    if positional:
        refuse_positional("norm", "x, weight, bias", 3 + len(positional))
    if removed:
        refuse_keywords("norm", removed)
    return add_norm(
        x, None, weight, bias, kind=kind, c=c, eps=eps, gate=gate, gate_act=gate_act,
        gate_position=gate_position, num_groups=num_groups, weight_offset=weight_offset, out_dtype=out_dtype,
        quant=quant, scale=scale,
    )[0]
