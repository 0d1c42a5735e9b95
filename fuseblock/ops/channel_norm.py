"""Channel norms of (N, C, *) inputs: `batch_norm`, `group_norm`, `instance_norm`.

The Triton path (`fuseblock.kernels.channel_norm`): one program per normalized set of a
strided (N, C, L) view of x, L the product of the trailing dims, with the weight and bias
loaded per channel:
- batch norm (training): program c normalizes channel c over its N*L values, and
  updates the running buffers' entry c in the same launch (eagerly; under torch.compile
  the buffers are updated by torch ops on the op's statistics, which Inductor fuses);
- group norm: program (n, g) normalizes the C/G channels x L values of group g of
  sample n; instance norm is group norm with one group per channel.
Launches per call, torch ops included: one forward; backward one for batch norm (a
program owns its channel, so it writes dw[c], db[c] itself) and for group norm of one
sample, two for group norm of several (fp32 partials of dw, db per sample, then the core
op's `_bwd_sum` in `fuseblock.kernels.launch`). Forward and backward are registered by `fuseblock.ops.registry.FusedOp`,
so torch.compile(fullgraph=True) traces them whole.

Why a program per set rather than the core op's row kernels: batch norm on those took
transposing copies in and out and its affine as separate elementwise ops (6 / 10
launches backward), and group norm repeated the per-channel weight per column (3 to 4).
The cost: a set longer than one block is read twice each way, and batch norm runs C
programs, few when C is small and N*L large (a split reduction would spread them).

The torch path (CPU tensors without TRITON_INTERPRET=1, float64, torch.func transforms)
is the reference's plain differentiable ops: batch norm as the layer norm of the
transposed batch (`fuseblock.reference.channel_norm`; docs/family.md: "layer norm is the
transpose of batch norm"), group norm as the core op with num_groups and the weight
repeated per column.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import increment_version

from ..reference.channel_norm import batch_norm_fwd, update_running
from ..spec import acc_dtype
from .checks import check_eps, check_int, check_number, check_tensor
from .dispatch import func_transforms_active, kernels, uses_triton
from .norm import norm
from .registry import FusedOp, placeholder


def _check_input(x, what: str, min_dim: int) -> tuple[int, int, int]:
    """(N, C, L) of an (N, C, *) input, L the product of the trailing dims."""
    check_tensor("x", x)
    if x.dim() < min_dim:
        raise ValueError(f"x must be {what}, got shape {tuple(x.shape)}")
    n, n_ch = x.shape[0], x.shape[1]
    length = math.prod(x.shape[2:])
    if n_ch < 1 or length < 1:
        raise ValueError(f"x must have at least one channel and one value per channel, got shape {tuple(x.shape)}")
    return n, n_ch, length


def _check_channel_vectors(x: Tensor, n_ch: int, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None:
            check_tensor(name, t, x)
            if tuple(t.shape) != (n_ch,):
                raise ValueError(f"{name} must have shape ({n_ch},) (one value per channel of x), got {tuple(t.shape)}")


def check_momentum(momentum, *, allow_none: bool = False) -> None:
    if momentum is None and allow_none:
        return
    check_number("momentum", momentum)
    if not 0 <= momentum <= 1:
        raise ValueError(f"momentum must be in [0, 1], got {momentum}")


# --------------------------------------------------------------------------- Triton path registration
def _fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], batch: bool, groups: int,
         eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd): sets per channel over the batch (batch), else per sample and group."""
    return kernels("channel_norm", x).channel_norm_fwd(x, weight, bias, batch, groups, eps)


def _eager_fwd(x, weight, bias, batch, groups, eps, *, running_mean, running_var, momentum):
    """_fwd, also updating batch norm's running buffers in its launch (eager only: see FusedOp)."""
    out = kernels("channel_norm", x).channel_norm_fwd(x, weight, bias, batch, groups, eps,
                                                     running_mean, running_var, momentum)
    # the kernel wrote them behind autograd's back: bump their versions as an in-place op
    # would, so a graph that saved them notices
    increment_version((running_mean, running_var))
    return out


def _fwd_fake(x, weight, bias, batch, groups, eps):
    n_sets = x.shape[1] if batch else x.shape[0] * groups
    stat = (n_sets,)
    return x.new_empty(x.shape), x.new_empty(stat, dtype=torch.float32), x.new_empty(stat, dtype=torch.float32)


def _bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor, rstd: Tensor,
         batch: bool, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = kernels("channel_norm", x).channel_norm_bwd(dy, x, weight, bias, mean, rstd, batch, groups)
    return dx, placeholder(x) if dw is None else dw, placeholder(x) if db is None else db


def _bwd_fake(dy, x, weight, bias, mean, rstd, batch, groups):
    n_ch = x.shape[1]
    return (x.new_empty(x.shape), placeholder(x) if weight is None else weight.new_empty((n_ch,)),
            placeholder(x) if bias is None else bias.new_empty((n_ch,)))


def _setup(ctx, inputs, output):
    x, weight, bias, batch, groups, eps = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])  # y is not kept: x and the statistics give it
    ctx.batch, ctx.groups, ctx.eps = batch, groups, eps


def _grads(ctx, grad_outputs, bwd):
    dy = grad_outputs[0]
    if dy is None:  # no gradient reached y (grads are not materialized): none for x, w, b
        return (None, None, None)
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = bwd(dy, x, weight, bias, mean, rstd, ctx.batch, ctx.groups)
    return dx, None if weight is None else dw, None if bias is None else db  # in their own dtypes


def _graph_grads(ctx, grad_outputs):
    """(dx, dw, db) as differentiable torch ops, for create_graph=True: y rebuilt from the
    saved x by torch's own batch / group norm, in fp32, and differentiated with a graph."""
    dy = grad_outputs[0]
    x, weight, bias, _, _ = ctx.saved_tensors
    leaves = [t for t in (x, weight, bias) if t is not None and t.requires_grad]
    if dy is None or not leaves:
        return (None, None, None)
    acc = acc_dtype(x.dtype)
    w, b = (None if t is None else t.to(acc) for t in (weight, bias))
    if ctx.batch:
        y = F.batch_norm(x.to(acc), None, None, w, b, True, 0.0, ctx.eps)
    else:
        y = F.group_norm(x.to(acc), ctx.groups, w, b, ctx.eps)
    got = dict(zip(map(id, leaves), torch.autograd.grad(y, leaves, dy.to(acc), create_graph=True, allow_unused=True),
                   strict=True))
    return tuple(None if t is None or got.get(id(t)) is None else got[id(t)].to(t.dtype) for t in (x, weight, bias))


channel_norm_op = FusedOp("channel_norm", _fwd, _fwd_fake, _bwd, _bwd_fake, _setup, _grads, stats=(1, 2),
                          graph_grads=_graph_grads, eager_fwd=_eager_fwd)


def _kernel_path(x: Tensor) -> bool:
    return uses_triton(x) and not func_transforms_active()


def batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """torch.nn.functional.batch_norm for (N, C) and (N, C, L) inputs (any (N, C, *)).

    Training: normalize each channel by its batch mean and biased variance, and, when
    running buffers are given, update them in place: r = (1 - momentum) * r + momentum * s,
    with the unbiased variance for running_var. Eval: normalize by the running stats.
    Math in fp32 (fp64 for fp64 x), one rounding to x's dtype.
    """
    n, n_ch, length = _check_input(x, "(N, C) or (N, C, L)", 2)
    _check_channel_vectors(x, n_ch, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias)
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {type(training).__name__}")
    check_momentum(momentum)
    check_eps(eps)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must be given together (or both None)")
    affine_shape = (n_ch,) + (1,) * (x.dim() - 2)  # broadcasts a channel vector over (N, C, *)

    if not training:
        if running_mean is None:
            raise ValueError("running_mean and running_var are required when training=False")
        # y = x * s + t with s = w / sqrt(var + eps), t = b - mean * s: elementwise, no reduction
        s = torch.rsqrt(running_var.to(acc_dtype(x.dtype)) + eps)
        if weight is not None:
            s = s * weight
        t = -running_mean * s if bias is None else bias - running_mean * s
        return torch.addcmul(t.view(affine_shape), x.to(s.dtype), s.view(affine_shape)).to(x.dtype)

    rows = n * length
    if rows < 2:
        raise ValueError(f"x: expected more than 1 value per channel when training, got shape {tuple(x.shape)}")
    if not _kernel_path(x):
        return batch_norm_fwd(x, running_mean, running_var, weight, bias, momentum, float(eps))
    if running_mean is None:
        return channel_norm_op(x, weight, bias, True, 0, float(eps))[0]
    if torch.compiler.is_compiling():  # the custom op mutates nothing: the update is torch ops here
        y, mean, rstd = channel_norm_op(x, weight, bias, True, 0, float(eps))
        update_running(running_mean, running_var, mean, rstd, momentum, eps, rows)
        return y
    return channel_norm_op(x, weight, bias, True, 0, float(eps), running_mean=running_mean, running_var=running_var,
                           momentum=float(momentum))[0]


def group_norm(
    x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """torch.nn.functional.group_norm for (N, C, *) inputs: each sample's C*L values
    normalized in num_groups groups of whole channels, then the per-channel affine."""
    n, n_ch, length = _check_input(x, "(N, C) or (N, C, *)", 2)
    _check_channel_vectors(x, n_ch, weight=weight, bias=bias)
    check_int("num_groups", num_groups)
    if n_ch % num_groups:
        raise ValueError(f"num_groups must be >= 1 and divide the channel count {n_ch}, got {num_groups}")
    check_eps(eps)
    if _kernel_path(x):
        return channel_norm_op(x, weight, bias, False, int(num_groups), float(eps))[0]
    # the torch path: the core op with groups
    if length > 1:  # per channel -> per column of the flattened sample
        weight = None if weight is None else weight.repeat_interleave(length)
        bias = None if bias is None else bias.repeat_interleave(length)
    out = norm(x.reshape(n, n_ch * length), weight, bias, kind="layer", eps=eps, num_groups=int(num_groups))
    return out.view(x.shape)


def instance_norm(
    x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """torch.nn.functional.instance_norm (no running stats) for (N, C, L) inputs (any (N, C, *)):
    group norm with one group per channel."""
    _, n_ch, length = _check_input(x, "(N, C, L)", 3)
    if length < 2:
        raise ValueError(f"x: expected more than 1 value per instance (N, C), got shape {tuple(x.shape)}")
    return group_norm(x, n_ch, weight, bias, eps)
