"""The torch path of `embed_norm` (fuseblock.ops.embed_norm): y = x / max(n(x), eps) over the
last dim, n = sum|x| ("l1"), sqrt(x.x) ("l2") or max|x| ("max"), as plain differentiable ops."""
from __future__ import annotations

import torch
from torch import Tensor

from ..spec import Ord, acc_dtype


def _stat(xa: Tensor, ord: Ord) -> Tensor:
    if ord == Ord.L1:
        return xa.abs().sum(-1)
    if ord == Ord.L2:
        return torch.linalg.vector_norm(xa, dim=-1)
    if ord == Ord.MAX:
        return xa.abs().amax(-1)
    raise ValueError(f"unknown embedding norm {ord!r}")


def embed_norm_fwd(x: Tensor, ord: Ord, eps: float) -> tuple[Tensor, Tensor]:
    """Same contract as `fuseblock.kernels.embed_norm.embed_norm_fwd`: (y, n), n in fp32 (fp64
    for fp64 x). Plain differentiable ops: autograd's subgradients of them are the ones
    `fuseblock.ops.embed_norm` describes."""
    xa = x.to(acc_dtype(x.dtype))
    n = _stat(xa, ord)
    return (xa / n.clamp_min(eps)[..., None]).to(x.dtype), n
