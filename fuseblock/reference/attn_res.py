"""The pure-PyTorch path of the attention residual (`fuseblock.attn_res_norm`): plain
differentiable torch ops, the contract of the Triton launchers in `fuseblock.kernels.attn_res`.

Autograd differentiates these ops (the backward the kernels implement is derived in
docs/math.md). The math is in `fuseblock.attn_res_spec`. Keys, scores and the mix are formed
in fp32 (fp64 for fp64 sources), the mix rounded once to the sources' dtype, then the norm
is `fuseblock.norm`'s (torch's rms_norm), as the kernels do.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..attn_res_spec import AttnResSpec, Form
from ..spec import NormSpec, acc_dtype
from . import norm as reference


def update(partial: Tensor | None, branch: Tensor, dtype: torch.dtype) -> Tensor:
    """partial' = partial + branch (branch alone without a partial), rounded once to dtype."""
    acc = acc_dtype(dtype)
    new = branch.to(acc) if partial is None else partial.to(acc) + branch.to(acc)
    return new.to(dtype)


def mix(v: Tensor, query: Tensor, spec: AttnResSpec) -> tuple[Tensor, Tensor]:
    """(mixed, a) of the sources v (..., S, d) in the accumulation dtype: mixed (..., d), a (..., S).
    Form INKLING2 takes Inkling2BlockAttentionResidual's ops: its eager attention of one
    query (..., 1, d) over the keys, scores and mix two batched matmuls."""
    r = torch.rsqrt(v.square().mean(-1, keepdim=True) + spec.key_eps)
    k = v * r
    u = k if spec.normed_values else v
    if spec.form == Form.INKLING2:
        q = query.to(v.dtype).expand(*k.shape[:-2], 1, k.shape[-1])
        a = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * spec.scale, dim=-1)
        return torch.matmul(a, u).squeeze(-2), a.squeeze(-2)
    a = torch.softmax(spec.scale * (k @ query.to(v.dtype)), dim=-1)
    return (a.unsqueeze(-1) * u).sum(-2), a


def out_norm(mixed: Tensor, weight: Tensor | None, spec: AttnResSpec) -> Tensor:
    """y = rms_norm(mixed, weight, eps), as `fuseblock.norm` computes it."""
    nspec = NormSpec.of(spec.d, kind="rms", c=None, eps=spec.eps, num_groups=1, gate_act=None, gate_position=None)
    return reference.norm_fwd(mixed, None, None, weight, None, nspec, None, False)[0]


def attn_res_fwd(sources: Tensor, partial: Tensor | None, branch: Tensor | None, query: Tensor,
                 weight: Tensor | None, spec: AttnResSpec) -> tuple[Tensor, Tensor, Tensor | None]:
    """(y, mixed, partial' or None): y and mixed in the sources' dtype."""
    acc = acc_dtype(sources.dtype)
    v = sources.to(acc)
    new_partial = None
    if spec.update:
        new_partial = update(partial, branch, sources.dtype)
        v = torch.cat([v, new_partial.to(acc).unsqueeze(-2)], dim=-2)
    mixed = mix(v, query, spec)[0].to(sources.dtype)
    return out_norm(mixed, weight, spec), mixed, new_partial
