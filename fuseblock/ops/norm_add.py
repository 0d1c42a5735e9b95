"""`norm_add` and `norm_add_norm`: the post-norm and sandwich (Peri-LN) residual updates.

    norm_add:       new_residual = residual + alpha * N_b(x)                (OLMo2's post-norm)
    norm_add_norm:  new_residual = residual + alpha * N_b(x),  out = N(new_residual)
                                                       (Gemma2/3's and GLM4's sandwich norms)

Dispatch as `fuseblock.ops.norm`'s: the Triton kernels (`fuseblock.kernels.norm_add`,
one forward launch that holds both norms, a backward of at most two) registered through
`FusedOp`; the torch path (`fuseblock.reference.norm.norm_add_fwd`) as plain differentiable
torch ops. Rows wider than the kernels' tile (more than MAX_TILE_BWD columns) take loop
kernels with the same launch counts (see `fuseblock.kernels.norm_add`).
"""
from __future__ import annotations

from typing import List, NoReturn, Optional

import torch
from torch import Tensor
from torch.compiler import is_compiling

from ..reference import norm as reference
from ..spec import DEFAULT_GATE_ACT, DEFAULT_GATE_POSITION, Fp8Recipe, NormSpec, Quant, acc_dtype, stored_dtype
from . import dispatch, dtensor
from .checks import (
    check_number,
    check_scales,
    check_tensor,
    check_vector,
    default_eps,
    recipe_of,
    refuse_keywords,
    resolve,
)
from .dispatch import func_transforms_active, kernels, uses_triton
from .norm import NO_SCALE, PLAIN
from .registry import FusedOp, live, placeholder, placeholders


def _unpack(spec: List[float] | tuple[NormSpec, NormSpec, float]) -> tuple[NormSpec, NormSpec, float]:  # noqa: UP006
    """(branch spec, spec, alpha) from what crosses the custom-op boundary (packed), or as the eager
    calls pass it (that tuple itself)."""
    if spec.__class__ is tuple:
        return spec
    n = len(spec) // 2
    return NormSpec.unpack(spec[:n]), NormSpec.unpack(spec[n:-1]), spec[-1]


# typing.List, not list: torch 2.5's schema inference knows only the typing forms (as ops.norm)
def _fwd(
    x: Tensor, residual: Tensor, branch_weight: Optional[Tensor], branch_bias: Optional[Tensor],
    weight: Optional[Tensor], bias: Optional[Tensor], spec: List[float], residual_dtype: torch.dtype,  # noqa: UP006
    second: bool, need_stats: bool, residual_scale: Optional[Tensor] = None, branch_scale: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return placeholders(x, _launch_fwd(x, residual, branch_weight, branch_bias, weight, bias, spec, residual_dtype,
                                       second, need_stats, residual_scale, branch_scale))


def _launch_fwd(x, residual, branch_weight, branch_bias, weight, bias, spec, residual_dtype, second, need_stats,
                residual_scale=None, branch_scale=None):
    """`_fwd` with None for each absent output: what the eager Function runs."""
    bspec, nspec, alpha = _unpack(spec)
    return kernels("norm_add", x).norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias, bspec, nspec,
                                               alpha, residual_dtype, second, need_stats, rscale=residual_scale,
                                               bscale=branch_scale)


def _fwd_fake(x, residual, branch_weight, branch_bias, weight, bias, spec, residual_dtype, second, need_stats,
              residual_scale=None, branch_scale=None):
    second_spec = _unpack(spec)[1]
    center = second_spec.center
    rows = x.numel() // x.shape[-1]

    def stat(on):
        return x.new_empty((rows,), dtype=torch.float32) if need_stats and on else placeholder(x)

    out = x.new_empty(x.shape, dtype=second_spec.out_dtype_for(x.dtype)) if second else placeholder(x)
    return (x.new_empty(x.shape, dtype=residual_dtype), out,
            stat(True), stat(center), stat(second), stat(second and center))


def _bwd(
    dout: Optional[Tensor], dres: Optional[Tensor], x: Tensor, p: Optional[Tensor], branch_weight: Optional[Tensor],
    branch_bias: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], rstd_b: Tensor,
    mean_b: Optional[Tensor], rstd: Optional[Tensor], mean: Optional[Tensor], spec: List[float],  # noqa: UP006
    residual_grad_dtype: torch.dtype, second: bool, store_dr: bool, residual: Optional[Tensor] = None,
    residual_scale: Optional[Tensor] = None, branch_scale: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return placeholders(x, _launch_bwd(dout, dres, x, p, branch_weight, branch_bias, weight, bias, rstd_b, mean_b,
                                       rstd, mean, spec, residual_grad_dtype, second, store_dr, residual,
                                       residual_scale, branch_scale))


def _launch_bwd(dout, dres, x, p, branch_weight, branch_bias, weight, bias, rstd_b, mean_b, rstd, mean, spec,
                residual_grad_dtype, second, store_dr, residual=None, residual_scale=None, branch_scale=None):
    """`_bwd` with None for each absent gradient: what the eager Function runs."""
    bspec, nspec, alpha = _unpack(spec)
    return kernels("norm_add", x).norm_add_bwd(dout, dres, x, p, branch_weight, branch_bias, weight, bias, rstd_b,
                                               mean_b, rstd, mean, bspec, nspec, alpha, residual_grad_dtype, second,
                                               store_dr, residual, residual_scale, branch_scale)


def _bwd_fake(dout, dres, x, p, branch_weight, branch_bias, weight, bias, rstd_b, mean_b, rstd, mean, spec,
              residual_grad_dtype, second, store_dr, residual=None, residual_scale=None, branch_scale=None):
    d = x.shape[-1]

    def param(t, on=True):
        return x.new_empty((d,), dtype=t.dtype) if t is not None and on else placeholder(x)

    return (x.new_empty(x.shape), x.new_empty(x.shape, dtype=residual_grad_dtype) if store_dr else placeholder(x),
            param(branch_weight), param(branch_bias), param(weight, second), param(bias, second),
            param(residual_scale), param(branch_scale))


def _setup(ctx, inputs, output):
    x, residual, branch_weight, branch_bias, weight, bias, spec, _, second, _, *scales = inputs
    rscale, bscale = scales or (None, None)  # the [d] scales, which a plain call does not pass
    new_res, _, rstd_b, mean_b, rstd, mean = output
    ctx.bspec, ctx.spec, ctx.alpha = _unpack(spec)
    ctx.second = second
    ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
    # Backward needs x, the stored new_residual (only for the second norm) and each norm's
    # row statistics; never the normalized outputs. The biases only say their dtypes.
    center = ctx.spec.center
    # A [d] residual scale's gradient is a column sum of dp * residual, an interpolation's b's one
    # of dp * (N_b(x) - residual): the residual is kept for them
    keep = rscale is not None or ctx.bspec.interpolate
    ctx.save_for_backward(x, new_res if second else None, branch_weight, branch_bias, weight, bias, rstd_b,
                          mean_b if center else None, rstd if second else None, mean if second and center else None,
                          residual if keep else None, rscale, bscale)
    return () if second else (1,)  # without the second norm, out is an empty placeholder (or None, eager)


def _grads(ctx, grad_outputs, bwd):
    """(dx, dresidual, dbranch_weight, dbranch_bias, dweight, dbias, None x 4,
    dresidual_scale, dbranch_scale) from the saved context."""
    dres, dout = grad_outputs[:2]
    x, p, bw, bb, w, b, rstd_b, mean_b, rstd, mean, residual, rscale, bscale = ctx.saved_tensors
    if (rstd_b is None or rstd_b.numel() == 0) and x.numel() > 0:  # None: the eager forward's absent statistics
        raise RuntimeError("fuseblock: backward through a norm_add whose forward ran without grad enabled")
    # norm_add's r' = r + alpha * N(x) passes the gradient at r' through to r: in r's dtype it
    # is dresidual itself, returned as it came, where a kernel would write a copy of it
    # (a residual_scale makes dresidual = a * dp another tensor, an interpolation (1 - b) * dp)
    passed = (not ctx.second and dres is not None and dres.dtype == ctx.residual_dtype and rscale is None
              and ctx.bspec.residual_scale == 1.0 and not ctx.bspec.interpolate)
    specs = ((ctx.bspec, ctx.spec, ctx.alpha) if bwd is _launch_bwd  # eager: unpacked, as ops.norm's
             else [*ctx.bspec.pack(), *ctx.spec.pack(), ctx.alpha])
    found = bwd(dout if ctx.second else None, dres, x, p, bw, bb, w, b, rstd_b, mean_b, rstd, mean, specs,
                ctx.residual_dtype, ctx.second, not passed, residual, rscale, bscale)
    if passed:
        found = (found[0], dres, *found[2:])
    dx, dr, dbw, dbb, dw, db = found[:6]  # written out, not a generator: this runs on every eager backward
    grads = (dx, dr, None if bw is None else dbw, None if bb is None else dbb, None if w is None else dw,
             None if b is None else db)
    if rscale is None and bscale is None:
        return grads
    return (*grads, None, None, None, None, found[6] if rscale is not None else None,
            found[7] if bscale is not None else None)


def _graph_grads(ctx, grad_outputs):
    """The same gradients as differentiable torch ops, for create_graph=True: each norm is
    rebuilt by the reference's composition from what was saved (x, and the stored
    new_residual, this node's own output, through which a second derivative reaches x and
    residual) and autograd differentiates it with a graph."""
    dres, dout = grad_outputs[:2]
    x, p, bw, bb, w, b = ctx.saved_tensors[:6]
    residual, rscale, bscale = ctx.saved_tensors[10:]
    if ctx.bspec.interpolate:
        return _interpolation_graph_grads(ctx, dres, dout, x, residual, bscale)
    found = {}

    def grad_of(out, leaves, dgrad):
        leaves = [t for t in leaves if t is not None and t.requires_grad]
        if leaves and dgrad is not None:
            found.update(zip(map(id, leaves), torch.autograd.grad(out, leaves, dgrad, create_graph=True,
                                                                  allow_unused=True), strict=True))

    dp = dres
    if ctx.second and dout is not None:
        pp = p if p.requires_grad else p.detach().requires_grad_()
        out = reference.norm_out(pp.to(acc_dtype(p.dtype)), None, w, b, ctx.spec)[0].to(
            ctx.spec.out_dtype_for(ctx.x_dtype))
        grad_of(out, (pp, w, b), dout)
        dpn = found.get(id(pp))
        if dpn is not None:
            dp = dpn if dp is None else dp + dpn
    drs = dbs = None
    if dp is not None:
        xx = x if x.requires_grad else x.detach().requires_grad_()
        y0 = reference.norm_out(xx.to(acc_dtype(x.dtype)), None, bw, bb, ctx.bspec)[0]
        y = y0 * ctx.alpha if bscale is None else y0 * bscale.to(y0.dtype)
        grad_of(y, (xx, bw, bb), dp)
        rows = dp.reshape(-1, dp.shape[-1])
        if bscale is not None:  # d b = sum over rows of dp * N_b(x)
            dbs = (rows * y0.reshape(rows.shape).to(rows.dtype)).sum(0).to(bscale.dtype)
        if rscale is not None:  # d a = sum over rows of dp * r, and dresidual = a * dp
            drs = (rows * residual.reshape(rows.shape).to(rows.dtype)).sum(0).to(rscale.dtype)
            dp = dp * rscale.to(dp.dtype)
        elif ctx.bspec.residual_scale != 1.0:
            dp = dp * ctx.bspec.residual_scale
    dx = found.get(id(x))
    grads = (None if dx is None else dx.to(ctx.x_dtype), None if dp is None else dp.to(ctx.residual_dtype),
             found.get(id(bw)), found.get(id(bb)), found.get(id(w)), found.get(id(b)))
    return grads if rscale is None and bscale is None else (*grads, None, None, None, None, drs, dbs)


def _interpolation_graph_grads(ctx, dres, dout, x, residual, bscale):
    """_graph_grads of update="interpolate": the whole op rebuilt by the reference from x, the
    residual and b (the interpolation reads r itself) and differentiated with a graph."""
    leaves = [t if t.requires_grad else t.detach().requires_grad_() for t in (x, residual)]
    b = None if bscale is None else (bscale if bscale.requires_grad else bscale.detach().requires_grad_())
    new_res, out = reference.norm_add_fwd(leaves[0], leaves[1], None, None, None, None, ctx.bspec, ctx.spec,
                                          ctx.alpha, ctx.residual_dtype, ctx.second, None, b)
    pairs = [(t, g) for t, g in ((new_res, dres), (out, dout)) if t is not None and g is not None]
    wrt = leaves + ([] if b is None else [b])
    found = torch.autograd.grad([t for t, _ in pairs], wrt, [g for _, g in pairs], create_graph=True,
                                allow_unused=True) if pairs else [None] * len(wrt)
    grads = (found[0], found[1], None, None, None, None)
    return grads if bscale is None else (*grads, None, None, None, None, None, found[2])


norm_add_op = FusedOp("norm_add_norm", _fwd, _fwd_fake, _bwd, _bwd_fake, _setup, _grads, stats=(2, 3, 4, 5),
                      graph_grads=_graph_grads, launch_fwd=_launch_fwd, launch_bwd=_launch_bwd)


def _spec(x, residual, weight, bias, kind, eps, weight_offset, residual_dtype, out_dtype=None, quant=None,
          scale=None) -> NormSpec:
    """One norm's spec, every argument checked (resolve names weight and bias so)."""
    return resolve(x, residual, weight, bias, None, kind=kind, c=None, eps=eps, gate_act=DEFAULT_GATE_ACT,
                   gate_position=DEFAULT_GATE_POSITION, num_groups=1, residual_dtype=residual_dtype,
                   weight_offset=weight_offset, out_dtype=out_dtype, quant=quant, scale=scale)


def _scales(x, residual, like, alpha, residual_scale, branch_scale, bspec: NormSpec):
    """(bspec with the float residual scale, alpha, the [d] residual scale, the [d] branch
    scale), validated (`check_scales`)."""
    alpha, rs, rscale, bscale = check_scales(x, residual, like, alpha, residual_scale, branch_scale)
    if rs != 1.0 or rscale is not None or bscale is not None:
        dtensor.refuse_scales(x, residual, rscale, bscale)
    return (bspec if rs == 1.0 else bspec.with_branch(bspec.alpha, bspec.dropout_p, rs)), alpha, rscale, bscale


UPDATES = ("add", "interpolate")


def _check_update(op: str, update, kind, **tensors) -> bool:
    """Whether the call interpolates (update="interpolate"; "add" is the default), with what
    that takes checked: kind "l2" and no weight or bias (`tensors`: the call's), nGPT's norms."""
    if update.__class__ is str and update == "add":
        return False
    if not isinstance(update, str) or update not in UPDATES:
        raise ValueError(f"update must be one of {UPDATES}, got {update!r}")
    if kind != "l2":
        raise ValueError(f"{op}: update='interpolate' normalizes onto the unit sphere (nGPT's L2 norms, eps on the "
                         f"sum of squares): it takes kind='l2', got kind={kind!r}")
    for name, t in tensors.items():
        if t is not None:
            raise ValueError(f"{op}: update='interpolate''s norms take no weight or bias (nGPT's unit sphere): "
                             f"{name} must be None")
    return True


def _interpolated(x, residual, bspec: NormSpec, spec: NormSpec, rscale, quant, out_dtype):
    """(bspec, spec) of update="interpolate": new_residual = r + b * (N_b(x) - r), each norm
    x * rsqrt(x.x + eps) (spec.eps_on_sum). What it does not take is refused by name."""
    if bspec.residual_scale != 1.0 or rscale is not None:
        raise ValueError("update='interpolate' takes no residual_scale: r' = r + b * (N_b(x) - r), whose one scale "
                         "is b (branch_scale, or alpha)")
    if quant is not None:
        raise ValueError("quant= does not take update='interpolate' yet")
    if out_dtype is not None:
        raise ValueError("out_dtype does not take update='interpolate' yet: out has x's dtype")
    if dtensor.has_dtensor(x, residual, None, None, None):
        raise ValueError("update='interpolate' does not take DTensor inputs yet: run it on each rank's local tensors")
    return bspec.interpolating(True), spec.interpolating(False)


def _apply(x, residual, branch_weight, branch_bias, weight, bias, bspec, spec, alpha, rdtype, second, rscale=None,
           bscale=None):
    """(new_residual, out or None) on validated arguments, by the path that serves x."""
    if dtensor.has_dtensor(x, residual, branch_weight, branch_bias, weight, bias):  # docs/parallel.md
        return dtensor.norm_add(_apply, x, residual, branch_weight, branch_bias, weight, bias, bspec, spec, alpha,
                                rdtype, second)
    if not uses_triton(x) or func_transforms_active():
        return reference.norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias, bspec, spec, alpha,
                                      rdtype, second, rscale, bscale)
    # written out, not a generator over the six: this runs on every kernel-path call
    need_stats = torch.is_grad_enabled() and (
        x.requires_grad or residual.requires_grad or (branch_weight is not None and branch_weight.requires_grad)
        or (branch_bias is not None and branch_bias.requires_grad) or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad) or (rscale is not None and rscale.requires_grad)
        or (bscale is not None and bscale.requires_grad))
    scales = () if rscale is None and bscale is None else (rscale, bscale)
    new_res, out, *_ = norm_add_op(x, residual, branch_weight, branch_bias, weight, bias,
                                   [*bspec.pack(), *spec.pack(), alpha], rdtype, second, need_stats, *scales)
    return new_res, (out if second else None)


# Plain norm_add calls already validated (no [d] scales, plain tensors): what the checks
# resolved of them (the branch spec, spec, alpha, new_residual dtype and the forward launcher),
# by what the checks read of them (dtypes, devices, x's last dim, shapes against x's, layouts),
# the options and whether CPU tensors take the kernels; as ops.norm's plain kernel calls. Bounded.
_PLAIN_CALLS: dict = {}


def _plain_call(x, residual, weight, bias, kind, eps, weight_offset, alpha, residual_dtype) -> Optional[Tensor]:
    """norm_add's new_residual for a plain call, or None for the checked path: under a torch.func
    transform, for x with no dims, a residual not of x's shape, an option of another class than
    the defaults' (eps None or a float, weight_offset and alpha floats) and what is not hashable.
    A call is validated once per signature by the checked path's own checks (their errors name
    the argument), then run with what they resolved."""
    if (func_transforms_active() or not x.ndim or residual.shape != x.shape or alpha.__class__ is not float
            or weight_offset.__class__ is not float or (eps is not None and eps.__class__ is not float)):
        return None
    # dispatch.CPU_KERNELS: with x's dtype and device, the path (uses_triton) the launcher was chosen by
    key = (dispatch.CPU_KERNELS, kind, eps, weight_offset, alpha, residual_dtype, x.dtype, x.device, x.shape[-1],
           x.layout, x.is_nested,
           residual.dtype, residual.device, residual.layout, residual.is_nested,
           None if weight is None else (weight.dtype, weight.device, weight.shape, weight.layout, weight.is_nested),
           None if bias is None else (bias.dtype, bias.device, bias.shape, bias.layout, bias.is_nested))
    try:
        found = _PLAIN_CALLS[key]
    except KeyError:
        check_tensor("x", x)
        check_tensor("residual", residual)
        spec = _spec(x, residual, weight, bias, kind, default_eps(x.dtype, kind) if eps is None else eps,
                     weight_offset, residual_dtype)
        bspec, alpha_, _, _ = _scales(x, residual, weight, alpha, NO_SCALE, None, spec)
        rdtype = stored_dtype(x.dtype, residual.dtype, residual_dtype)
        found = (bspec, spec, alpha_, rdtype, kernels("norm_add", x).norm_add_fwd if uses_triton(x) else None)
        if len(_PLAIN_CALLS) < 4096:
            _PLAIN_CALLS[key] = found
    except TypeError:  # unhashable: kind (a list, say), which the checks name
        return None
    bspec, spec, alpha, rdtype, launch = found
    if launch is None:  # the torch path
        return reference.norm_add_fwd(x, residual, weight, bias, None, None, bspec, spec, alpha, rdtype, False)[0]
    x, residual = live(x), live(residual)
    weight = None if weight is None else live(weight)
    bias = None if bias is None else live(bias)
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad
                                    or (weight is not None and weight.requires_grad)
                                    or (bias is not None and bias.requires_grad)):
        return norm_add_op.eager(None, x, residual, weight, bias, None, None, (bspec, spec, alpha), rdtype, False,
                                 True)[0]
    return launch(x, residual, weight, bias, None, None, bspec, spec, alpha, rdtype, False, False)[0]


def norm_add(
    x: Tensor,
    residual: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    *,
    kind: str = "rms",
    eps: Optional[float] = None,
    weight_offset: float = 0.0,
    alpha: float = 1.0,
    residual_scale: float | Tensor = NO_SCALE,
    branch_scale: float | Tensor | None = None,
    residual_dtype: Optional[torch.dtype] = None,
    update: str = "add",
) -> Tensor:
    """Post-norm residual update: new_residual = residual + alpha * N(x), returned.

    N normalizes x over its last dim as `fuseblock.norm` does (kind "rms", "layer" or
    "l2"; weight and bias optional; weight_offset added to the weight in fp32);
    eps=None is torch's default for x's dtype (`fuseblock.ops.checks.default_eps`).
    alpha is a finite real number. N(x) is kept in fp32 and the sum rounded once, into
    residual_dtype: by default the dtype torch's `residual + N(x)` has (the residual's,
    or the wider of it and x's). One kernel launch forward on the kernel path.

    Per-channel scales: new_residual = a * residual + b * N(x), a = residual_scale,
    b = branch_scale, each a finite float or a (d,) tensor in fp32 or the weight's dtype
    (x's without a weight); alpha is branch_scale's float form (give one). A tensor
    scale's gradient is sum over rows of dp * residual (a) or dp * N(x) (b), from the
    backward's own launches.

    update="interpolate" (nGPT's update on the unit sphere, transformers' Dory):
    new_residual = residual + b * (N(x) - residual), b = branch_scale (or alpha), N the
    L2 norm x * rsqrt(x.x + eps), eps added to the sum of squares; kind="l2", no weight
    or bias, no residual_scale. The torch path computes DoryDecoderLayer's ops in its
    order (fp32: bitwise); the kernels take it as a flag of the same launches, b's
    gradient (sum over rows of dp * (N(x) - residual)) summed beside the others'.
    """
    if (residual_scale is NO_SCALE and branch_scale is None and update.__class__ is str and update == "add"
            and x.__class__ in PLAIN
            and residual.__class__ in PLAIN and (weight is None or weight.__class__ in PLAIN)
            and (bias is None or bias.__class__ in PLAIN) and not is_compiling()):  # the fast lane
        new_res = _plain_call(x, residual, weight, bias, kind, eps, weight_offset, alpha, residual_dtype)
        if new_res is not None:
            return new_res
    check_tensor("x", x)
    check_tensor("residual", residual)
    interpolate = _check_update("norm_add", update, kind, weight=weight, bias=bias)
    spec = _spec(x, residual, weight, bias, kind, default_eps(x.dtype, kind) if eps is None else eps, weight_offset,
                 residual_dtype)
    bspec, alpha, rscale, bscale = _scales(x, residual, weight, alpha, residual_scale, branch_scale, spec)
    if interpolate:
        bspec, spec = _interpolated(x, residual, bspec, spec, rscale, None, None)
    rdtype = stored_dtype(x.dtype, residual.dtype, residual_dtype)
    return _apply(x, residual, weight, bias, None, None, bspec, spec, alpha, rdtype, False, rscale, bscale)[0]


def norm_add_norm(
    x: Tensor,
    residual: Tensor,
    branch_weight: Optional[Tensor],
    weight: Optional[Tensor],
    branch_bias: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    *,
    kind: str = "rms",
    eps: Optional[float] = None,
    branch_eps: Optional[float] = None,
    weight_offset: float = 0.0,
    branch_weight_offset: Optional[float] = None,
    alpha: float = 1.0,
    residual_scale: float | Tensor = 1.0,
    branch_scale: float | Tensor | None = None,
    residual_dtype: Optional[torch.dtype] = None,
    out_dtype: Optional[torch.dtype] = None,
    quant: Optional[str | Fp8Recipe] = None,
    scale: Optional[Tensor] = None,
    update: str = "add",
    **removed: NoReturn,  # none: the former fp8 keywords, refused naming the recipe (refuse_keywords)
) -> tuple[Tensor, Tensor]:
    """Sandwich (Peri-LN) residual update, both norms in one kernel: returns (out, new_residual),

        new_residual = residual + alpha * N_b(x)      N_b: branch_weight, branch_bias, branch_eps
        out = N(new_residual)                         N: weight, bias, eps

    both of `kind`. branch_weight and weight are required tensors (None is refused) unless
    kind="l2", where None means no weight. branch_eps=None and branch_weight_offset=None
    mean the same as eps and weight_offset; eps=None is torch's default for the dtype each
    norm reads (x's for N_b, new_residual's for N). new_residual's dtype as in `norm_add`
    (N reads the stored value); out has x's dtype, or out_dtype: the fp32 result stored
    once in that dtype by the kernel (as `add_norm`'s), its gradient read in it.
    quant=... (a `fuseblock.Fp8Recipe` or a mode's name; scale=: fp8_tensor's) returns
    `Quantized` in place of out, as `add_norm`'s (its anchor takes the gradient at out in
    high precision when an input requires one); the recipe's mx_columnwise is not taken.
    residual_scale and branch_scale as in `norm_add`: new_residual = a * residual + b * N_b(x)
    (a tensor's dtype may be fp32 or branch_weight's); not with quant= yet.
    update="interpolate" as in `norm_add` (nGPT): new_residual = residual + b * (N_b(x) -
    residual), out = N(new_residual), both unit-sphere L2 norms x * rsqrt(x.x + eps);
    kind="l2", no weights or biases, no residual_scale, quant or out_dtype.
    """
    if removed:
        refuse_keywords("norm_add_norm", removed)
    check_tensor("x", x)
    check_tensor("residual", residual)
    if quant is not None and recipe_of(quant).mx_columnwise:
        raise ValueError("norm_add_norm's quant= takes no mx_columnwise (its output has no columnwise copy): use a "
                         "recipe with mx_columnwise=False")
    interpolate = _check_update("norm_add_norm", update, kind, branch_weight=branch_weight, weight=weight,
                                branch_bias=branch_bias, bias=bias)
    # checks x, kind, weight, bias and the output's options
    spec = _spec(x, residual, weight, bias, kind, eps, weight_offset, residual_dtype, out_dtype, quant, scale)
    if kind != "l2":
        for name, t in (("branch_weight", branch_weight), ("weight", weight)):
            if t is None:
                raise ValueError(f"norm_add_norm needs {name} for kind={kind!r} (None is accepted only for "
                                 "kind='l2')")
    for name, t in (("branch_weight", branch_weight), ("branch_bias", branch_bias)):
        if t is not None:
            check_vector(name, t, x, x.shape[-1])
    if branch_eps is None:
        branch_eps = default_eps(x.dtype, kind) if eps is None else eps
    else:
        check_number("branch_eps", branch_eps)
        if branch_eps < 0:
            raise ValueError(f"branch_eps must be >= 0, got {branch_eps}")
    if branch_weight_offset is None:
        branch_weight_offset = weight_offset
    else:
        check_number("branch_weight_offset", branch_weight_offset)
        if branch_weight_offset != 0 and branch_weight is None:
            raise ValueError(f"branch_weight_offset={branch_weight_offset} needs a branch_weight: it is added to it")
    bspec = _spec(x, residual, branch_weight, branch_bias, kind, branch_eps, branch_weight_offset, residual_dtype)
    bspec, alpha, rscale, bscale = _scales(x, residual, branch_weight, alpha, residual_scale, branch_scale, bspec)
    if interpolate:
        bspec, spec = _interpolated(x, residual, bspec, spec, rscale, quant, out_dtype)
    rdtype = stored_dtype(x.dtype, residual.dtype, residual_dtype)
    if spec.quant != Quant.NONE:
        if bspec.residual_scale != 1.0 or rscale is not None or bscale is not None:
            raise ValueError("quant= does not take residual_scale or a tensor branch_scale yet")
        if dtensor.has_dtensor(x, residual, branch_weight, branch_bias, weight, bias):
            raise ValueError("quant= does not take DTensor inputs yet: quantize each rank's local tensor")
        # here, not at the top: ops/fp8.py's torch.compiler.disable imports torch._dynamo
        from . import fp8 as quant_ops
        return quant_ops.quantized_norm_add(norm_add_op, x, residual, branch_weight, branch_bias, weight, bias, bspec,
                                            spec, alpha, rdtype, scale)
    new_res, out = _apply(x, residual, branch_weight, branch_bias, weight, bias, bspec, spec, alpha, rdtype, True,
                          rscale, bscale)
    return out, new_res
