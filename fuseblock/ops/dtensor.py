"""`norm` / `add_norm` on DTensors (torch.distributed.tensor), both paths. docs/parallel.md.

For each mesh dim, x's placement decides what runs there:
- Replicate, or Shard on a row dim (any dim but the last): the op runs on each rank's
  local rows, unchanged (the kernels or the torch path). A replicated weight or bias
  gets a Partial gradient on the row-sharded mesh dims, which DTensor sums across them.
- Shard on the normalized (last) dim, the weight and bias sharded the same way (Shard(0)):
  each rank sums its part of every row (the sum of squares; and the sum, for a layer
  norm) and one all-reduce of those fp64 sums completes the statistics: 8 bytes a row
  (rms, l2), 16 (layer). The backward all-reduces its two (or one) row dot products
  the same way. Rows are never gathered. This path is torch ops on the local shards
  under an autograd.Function, on both paths; gates and num_groups > 1 are refused there.
- anything else (Partial, a strided shard, a weight placed otherwise): a ValueError naming it.

Nothing here imports torch.distributed until a call passes a DTensor (importing it
costs about a second), and `add_norm` hands in its own local form, so this module does
not import `fuseblock.ops.norm`.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from ..spec import acc_dtype, new_residual_dtype
from .checks import resolve

_NAMES = ("x", "residual", "weight", "bias", "gate", "x1")


def has_dtensor(x, residual, weight, bias, gate, x1=None) -> bool:
    """Whether any argument is a DTensor: 0.09 us a call while torch.distributed.tensor is not
    loaded, 0.27 us once it is (this project's CPU). Written out, not looped over the
    arguments: on the eager torch path this is part of every small call's host time."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return False
    cls = module.DTensor
    return (isinstance(x, cls) or isinstance(weight, cls) or (residual is not None and isinstance(residual, cls))
            or (bias is not None and isinstance(bias, cls)) or (gate is not None and isinstance(gate, cls))
            or (x1 is not None and isinstance(x1, cls)))


def _placements(x, residual, weight, bias, gate, x1=None):
    """(mesh, row_dims, hidden_dims): the mesh dims on which x is sharded by rows and those on
    which it is sharded on its last dim, after checking every argument's placement."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tensors = dict(zip(_NAMES, (x, residual, weight, bias, gate, x1), strict=True))
    for name, t in tensors.items():
        if t is not None and not isinstance(t, DTensor):
            raise TypeError(f"{name} is a {type(t).__name__}, but another argument is a DTensor: pass every tensor "
                            f"as a DTensor on one mesh (DTensor.from_local, distribute_tensor; for a norm's "
                            f"inputs, shard it with fuseblock.parallel.SequenceParallel or HiddenParallel)")
    mesh, last = x.device_mesh, x.ndim - 1
    for name, t in tensors.items():
        if t is not None and t.device_mesh != mesh:
            raise ValueError(f"{name} is on mesh {t.device_mesh}, x on {mesh}: one mesh for every argument")
    row_dims, hidden_dims = [], []
    for i, p in enumerate(x.placements):
        if type(p) is Shard and p.dim % x.ndim == last:
            hidden_dims.append(i)
            vector = Shard(0)
        elif type(p) is Shard or type(p) is Replicate:
            if type(p) is Shard:
                row_dims.append(i)
            vector = Replicate()
        else:
            raise ValueError(f"x's placement {p!r} on mesh dim {i} is not supported: fuseblock's norms take x "
                             f"Replicate, Shard on a row dim, or Shard({last}) (the normalized dim); "
                             f"redistribute it first (docs/parallel.md)")
        for name in ("residual", "gate", "x1"):
            t = tensors[name]
            if t is not None and t.placements[i] != p:
                raise ValueError(f"{name}'s placement {t.placements[i]!r} on mesh dim {i} differs from x's {p!r}: "
                                 f"{name} must be placed as x is")
        for name in ("weight", "bias"):
            t = tensors[name]
            if t is not None and t.placements[i] != vector:
                raise ValueError(f"{name}'s placement {t.placements[i]!r} on mesh dim {i} does not fit x's {p!r}: "
                                 f"with x {p!r} the {name} must be {vector!r}")
    return mesh, row_dims, hidden_dims


def add_norm(local_add_norm: Callable, x, residual, weight, bias, gate, x1=None, **options):
    """`local_add_norm(x, residual, weight, bias, gate=gate, **options)` (fuseblock's add_norm)
    on DTensor arguments: (out, new_residual) as DTensors placed as x is. A second branch x1
    is placed as x; dropout is refused (every rank would draw the same masks for its own rows)."""
    from torch.distributed.tensor import DTensor, Partial

    if options.get("dropout_p", 0.0) != 0.0:
        raise ValueError(f"dropout_p={options['dropout_p']} on DTensors: each rank would draw the same masks "
                         f"for different rows; apply torch's dropout to the DTensor branch first")
    mesh, row_dims, hidden_dims = _placements(x, residual, weight, bias, gate, x1)
    # the weight's gradient: summed over the mesh dims whose ranks hold other rows
    vector_grad = [Partial() if i in row_dims else p for i, p in enumerate(weight.placements)] \
        if weight is not None else None
    bias_grad = [Partial() if i in row_dims else p for i, p in enumerate(bias.placements)] \
        if bias is not None else None

    def local(t, grad_placements=None):
        return None if t is None else _plain(t.to_local(grad_placements=grad_placements))

    xl, rl, gl = local(x), local(residual), local(gate)
    wl, bl = local(weight, vector_grad), local(bias, bias_grad)
    if x1 is not None:
        options["x1"] = local(x1)
    if not hidden_dims:
        out, new_res = local_add_norm(xl, rl, wl, bl, gate=gl, **options)
    else:
        out, new_res = _hidden_add_norm(x, residual, weight, bias, gate, xl, rl, wl, bl, mesh, hidden_dims, **options)

    # the outputs are new, contiguous tensors of x's global shape
    stride = tuple(math.prod(x.shape[i + 1:]) for i in range(x.dim()))

    def placed(t):
        return DTensor.from_local(_plain(t), mesh, x.placements, run_check=False, shape=x.shape, stride=stride)

    # no residual and no dtype change: new_residual is x itself, as add_norm's
    return placed(out), (x if new_res is xl else placed(new_res))


def _hidden_add_norm(x, residual, weight, bias, gate, xl, rl, wl, bl, mesh, hidden_dims, *, kind, c, eps,
                     residual_dtype, gate_act, gate_position, num_groups, weight_offset, x1=None, alpha=1.0,
                     dropout_p=0.0):
    if gate is not None or num_groups != 1 or x1 is not None or alpha != 1.0:
        raise ValueError(f"a gate, num_groups > 1, x1 and alpha are not supported with x sharded on its last dim "
                         f"(x's placements {tuple(x.placements)}): shard x by rows, or replicate it")
    # the global shapes: the spec's scale c/sqrt(d) and eps are the whole row's
    spec = resolve(x, residual, weight, bias, None, kind=kind, c=c, eps=eps, gate_act=gate_act,
                   gate_position=gate_position, num_groups=1, residual_dtype=residual_dtype,
                   weight_offset=weight_offset)
    from .. import reference

    rdtype = new_residual_dtype(x.dtype, None if residual is None else residual.dtype, residual_dtype)
    new_res = reference.residual_sum(xl, rl, rdtype)  # differentiable; autograd routes dnew_residual
    p = xl if new_res is None else new_res
    groups = [(mesh, i) for i in hidden_dims]
    out = _HiddenNorm.apply(p, wl, bl, spec, x.shape[-1], groups)
    return out.to(x.dtype), (xl if new_res is None else new_res)


def _plain(t: Tensor) -> Tensor:
    """t, and the gradient it is given, as plain tensors: a DTensor that an async collective
    made (a row-parallel Linear's reduce-scatter; in backward, a column-parallel Linear's
    all-gather) holds an AsyncCollectiveTensor, a subclass the kernels cannot read."""
    return _Plain.apply(t)


class _Plain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.wait() if _is_async(t) else t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.wait() if _is_async(grad) else grad


def _is_async(t) -> bool:
    import torch.distributed._functional_collectives as funcol

    return isinstance(t, funcol.AsyncCollectiveTensor)


def _all_reduce(t: Tensor, groups) -> Tensor:
    """The sum of t over the ranks of each (mesh, mesh dim) in groups (functional collectives:
    traceable, and counted by CommDebugMode)."""
    import torch.distributed._functional_collectives as funcol

    for group in groups:
        t = funcol.all_reduce(t, "sum", group)
        if isinstance(t, funcol.AsyncCollectiveTensor):
            t = t.wait()
    return t


class _HiddenNorm(torch.autograd.Function):
    """out = scale * (p - mean) * rstd * (weight_offset + w) + b over rows split across ranks
    on their last dim: the statistics from all-reduced fp64 row sums (docs/math.md's
    formulas; the gradients of docs/math.md with the row means all-reduced too)."""

    @staticmethod
    def forward(ctx, p: Tensor, w: Tensor | None, b: Tensor | None, spec, d: int, groups):
        a = acc_dtype(p.dtype)
        p64 = p.to(torch.float64)  # a temporary: nothing of the forward is kept but p and the statistics
        sums = [p64.sum(-1)] if spec.center else []
        sums.append(p64.square().sum(-1))
        total = _all_reduce(torch.stack(sums, -1), groups)
        mean = total[..., 0] / d if spec.center else None
        var = total[..., -1] / d - (mean.square() if spec.center else 0.0)
        rstd = torch.rsqrt(var.clamp_min(0.0) + spec.eps).to(a)
        mean = None if mean is None else mean.to(a)
        pa = p.to(a)
        r = ((pa - mean[..., None]) if spec.center else pa) * rstd[..., None]
        out = _affine(r, w, b, spec, a)
        ctx.save_for_backward(p, w, rstd, mean)
        ctx.spec, ctx.d, ctx.groups, ctx.bias_dtype = spec, d, groups, None if b is None else b.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # a second derivative would need the collectives' own
    def backward(ctx, dout: Tensor):
        p, w, rstd, mean = ctx.saved_tensors
        spec, d = ctx.spec, ctx.d
        a = rstd.dtype
        g = dout.to(a)
        pa = p.to(a)
        r = ((pa - mean[..., None]) if spec.center else pa) * rstd[..., None]
        dr = g * spec.scale
        lead = tuple(range(r.dim() - 1))
        dw = (dr * r).sum(lead).to(w.dtype) if w is not None and ctx.needs_input_grad[1] else None
        db = g.sum(lead).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        if w is not None:
            dr = dr * (w.to(a) + spec.weight_offset)
        dots = [dr.sum(-1, dtype=torch.float64)] if spec.center else []
        dots.append((dr * r).sum(-1, dtype=torch.float64))
        total = _all_reduce(torch.stack(dots, -1), ctx.groups) / d
        dp = dr - r * total[..., -1:].to(a)
        if spec.center:
            dp = dp - total[..., :1].to(a)
        dp = (dp * rstd[..., None]).to(p.dtype)
        return dp, dw, db, None, None, None


def _affine(r: Tensor, w: Tensor | None, b: Tensor | None, spec, a: torch.dtype) -> Tensor:
    o = r * spec.scale if spec.scale != 1.0 else r
    if w is not None:
        o = o * (w.to(a) + spec.weight_offset)
    if b is not None:
        o = o + b.to(a)
    return o


def keeps_inputs(hook: Callable, with_kwargs: bool) -> Callable:
    """`hook`, a module's forward pre-hook, refused where it drops positional inputs of a call
    that has more than one: torch's SequenceParallel style keeps only the first, which on an
    AddNorm would normalize x alone, the residual silently lost. A hook with kwargs returns
    (args, kwargs) and is left as it is."""
    if with_kwargs:
        return hook

    def checked(module, args):
        out = hook(module, args)
        if out is not None and len(args) > 1 and len(out if isinstance(out, tuple) else (out,)) < len(args):
            raise ValueError(f"a forward pre-hook of {type(module).__name__} dropped its residual (torch's "
                             f"SequenceParallel keeps only the first input): use fuseblock.parallel.SequenceParallel")
        return out

    return checked

