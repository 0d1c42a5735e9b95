"""`embed_norm`: the L1, L2 and max embedding normalizations of seed 003.

y = x / max(n(x), eps) over the last dim, with n = sum|x| ("l1"), sqrt(x.x) ("l2") or
max|x| ("max"): `torch.nn.functional.normalize` with p = 1, 2, inf, to the gradient.

Subgradients (the same as torch's autograd of that formula):
- at the clamp, n = eps exactly, the gradient flows through n (torch's clamp_min);
  below it, D = eps is a constant and dx = dy / eps;
- sign(0) = 0 for "l1" and "max";
- for "max", the k entries tied at max|x| share dn/dx equally (1/k each), like amax.

Forward and backward are `torch.library` custom ops with fake implementations, so
`torch.compile(fullgraph=True)` traces them whole; eager calls skip the dispatcher
through an autograd.Function over the same implementations, as the core op does.
Dispatch is `fuseblock.ops.dispatch`'s: the Triton kernels on CUDA (or
TRITON_INTERPRET=1), else the torch path here.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import func_transforms_active, kernels, uses_triton
from .spec import check_number, check_tensor

ORDS = {"l1": 1, "l2": 2, "max": 3}


# --------------------------------------------------------------------------- torch path
def _stat(xa: Tensor, ord: int) -> Tensor:
    if ord == 1:
        return xa.abs().sum(-1)
    if ord == 2:
        return torch.linalg.vector_norm(xa, dim=-1)
    return xa.abs().amax(-1)


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def torch_fwd(x: Tensor, ord: int, eps: float) -> tuple[Tensor, Tensor]:
    """Same contract as `kernels.embed_norm_fwd`: (y, n), n in fp32 (fp64 for fp64 x)."""
    xa = x.to(_acc(x))
    n = _stat(xa, ord)
    return (xa / n.clamp_min(eps)[..., None]).to(x.dtype), n


def torch_bwd(dy: Tensor, x: Tensor, n: Tensor, ord: int, eps: float) -> Tensor:
    """dx = (g - [n >= eps] * (g.x / D) * dn/dx) / D, D = max(n, eps) (module docstring)."""
    xa, g = x.to(n.dtype), dy.to(n.dtype)
    inv = 1.0 / n.clamp_min(eps)[..., None]
    c = torch.where(n[..., None] >= eps, (g * xa).sum(-1, keepdim=True) * inv, 0.0)
    if ord == 1:
        t = xa.sign()
    elif ord == 2:
        t = xa * inv
    else:
        top = xa.abs() == n[..., None]
        t = torch.where(top, xa.sign(), 0.0) / top.sum(-1, keepdim=True).clamp_min(1)
    return ((g - c * t) * inv).to(x.dtype)


# --------------------------------------------------------------------------- custom ops
def _fwd_impl(x: Tensor, ord: int, eps: float) -> tuple[Tensor, Tensor]:
    return (kernels("embed_norm", x).embed_norm_fwd if uses_triton(x) else torch_fwd)(x, ord, eps)


def _bwd_impl(dy: Tensor, x: Tensor, n: Tensor, ord: int, eps: float) -> Tensor:
    return (kernels("embed_norm", x).embed_norm_bwd if uses_triton(x) else torch_bwd)(dy, x, n, ord, eps)


_fwd = torch.library.custom_op("fuseblock::embed_norm_fwd", _fwd_impl, mutates_args=())
_bwd = torch.library.custom_op("fuseblock::embed_norm_bwd", _bwd_impl, mutates_args=())


@_fwd.register_fake
def _fwd_fake(x, ord, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=_acc(x))


@_bwd.register_fake
def _bwd_fake(dy, x, n, ord, eps):
    return x.new_empty(x.shape)


def _save(ctx, x: Tensor, n: Tensor, ord: int, eps: float) -> None:
    ctx.save_for_backward(x, n)  # y is not kept: the backward re-derives it from x and n
    ctx.ord, ctx.eps = ord, eps


def _setup_context(ctx, inputs, output):
    x, ord, eps = inputs
    _save(ctx, x, output[1], ord, eps)


def _op_backward(ctx, dy, _dn):
    x, n = ctx.saved_tensors
    return torch.ops.fuseblock.embed_norm_bwd(dy, x, n, ctx.ord, ctx.eps), None, None


torch.library.register_autograd("fuseblock::embed_norm_fwd", _op_backward, setup_context=_setup_context)


class _EagerEmbedNorm(torch.autograd.Function):
    """The custom op's forward/backward minus the dispatcher's per-call cost (eager only)."""

    @staticmethod
    def forward(ctx, x, ord, eps):
        y, n = _fwd_impl(x, ord, eps)
        _save(ctx, x, n, ord, eps)
        ctx.mark_non_differentiable(n)
        return y, n

    @staticmethod
    def backward(ctx, dy, _dn):
        x, n = ctx.saved_tensors
        return _bwd_impl(dy, x, n, ctx.ord, ctx.eps), None, None


def embed_norm(x: Tensor, ord: str = "l2", eps: float = 1e-12) -> Tensor:
    """x / max(n(x), eps) over the last dim; n = sum|x| ("l1"), sqrt(x.x) ("l2"), max|x| ("max").

    Equals torch.nn.functional.normalize(x, p, dim=-1, eps) for p = 1, 2, inf, values and
    gradients (see the module docstring for the subgradients). Output has x's dtype.
    """
    check_tensor("x", x)
    if x.dim() == 0 or x.shape[-1] < 1:
        raise ValueError(f"x must have a non-empty last dimension to normalize, got shape {tuple(x.shape)}")
    if not isinstance(ord, str) or ord not in ORDS:
        raise ValueError(f"ord must be one of {tuple(ORDS)}, got {ord!r}")
    check_number("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if func_transforms_active():  # torch.func sees through plain torch ops only (see fuseblock.ops.norm.apply_norm)
        return torch_fwd(x, ORDS[ord], float(eps))[0]
    fwd = torch.ops.fuseblock.embed_norm_fwd if torch.compiler.is_compiling() else _EagerEmbedNorm.apply
    return fwd(x, ORDS[ord], float(eps))[0]
