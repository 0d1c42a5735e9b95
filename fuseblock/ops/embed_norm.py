"""`embed_norm`: the L1, L2 and max embedding normalizations (docs/family.md).

y = x / max(n(x), eps) over the last dim, with n = sum|x| ("l1"), sqrt(x.x) ("l2") or
max|x| ("max"): `torch.nn.functional.normalize` with p = 1, 2, inf, to the gradient.

Subgradients (the same as torch's autograd of that formula):
- at the clamp, n = eps exactly, the gradient flows through n (torch's clamp_min);
  below it, D = eps is a constant and dx = dy / eps;
- sign(0) = 0 for "l1" and "max";
- for "max", the k entries tied at max|x| share dn/dx equally (1/k each), like amax.

Dispatch is `fuseblock.ops.dispatch`'s: the Triton kernels on CUDA (or
TRITON_INTERPRET=1), their forward and backward registered by
`fuseblock.ops.registry.FusedOp` as the core op's are; else the torch path,
`fuseblock.reference.embed_norm`: plain differentiable ops.
"""
from __future__ import annotations

from torch import Tensor

from ..reference.embed_norm import embed_norm_fwd
from ..spec import ORDS, Ord, acc_dtype
from .checks import check_eps, check_tensor
from .dispatch import func_transforms_active, kernels, uses_triton
from .registry import FusedOp


# --------------------------------------------------------------------------- registration
def _fwd(x: Tensor, ord: int, eps: float) -> tuple[Tensor, Tensor]:
    return kernels("embed_norm", x).embed_norm_fwd(x, Ord(ord), eps)


def _fwd_fake(x, ord, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=acc_dtype(x.dtype))


def _bwd(dy: Tensor, x: Tensor, n: Tensor, ord: int, eps: float) -> Tensor:
    return kernels("embed_norm", x).embed_norm_bwd(dy, x, n, Ord(ord), eps)


def _bwd_fake(dy, x, n, ord, eps):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    x, ord, eps = inputs
    ctx.save_for_backward(x, output[1])  # y is not kept: the backward re-derives it from x and n
    ctx.ord, ctx.eps = ord, eps


def _grads(ctx, grad_outputs, bwd):
    dy = grad_outputs[0]
    if dy is None:  # no gradient reached y (grads are not materialized): none for x
        return (None,)
    x, n = ctx.saved_tensors
    return (bwd(dy, x, n, ctx.ord, ctx.eps),)


embed_norm_op = FusedOp("embed_norm", _fwd, _fwd_fake, _bwd, _bwd_fake, _setup, _grads, stats=(1,))


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
    check_eps(eps)
    # the torch path, and torch.func transforms, run plain torch ops (see fuseblock.ops.norm.apply_norm)
    if not uses_triton(x) or func_transforms_active():
        return embed_norm_fwd(x, ORDS[ord], float(eps))[0]
    return embed_norm_op(x, int(ORDS[ord]), float(eps))[0]
