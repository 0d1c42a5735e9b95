"""The attention-residual ops: `attn_res_norm` and, at a block boundary, `attn_res_add_norm`.

Validation into an `AttnResSpec` (once per call), then dispatch as for the other ops
(`fuseblock.ops.dispatch`): the Triton kernels (`fuseblock.kernels.attn_res`, one launch
forward, two backward, registered as custom ops with their backward), or the torch path
(`fuseblock.reference.attn_res`), plain differentiable torch ops. The math is in
`fuseblock.attn_res_spec` and docs/stream.md ("Attention residuals").
"""
# No `from __future__ import annotations`: the custom ops' schemas are read from the annotations
from typing import List, Optional

import torch
from torch import Tensor

from ..attn_res_spec import FORMS, MAX_SOURCES, AttnResSpec
from ..reference import attn_res as attn_res_reference
from .checks import check_eps, check_number, check_tensor
from .dispatch import func_transforms_active, kernels, uses_triton
from .dtensor import has_dtensor
from .registry import FusedOp, placeholders


def _check_vector(name: str, t, sources: Tensor, d: int) -> None:
    check_tensor(name, t, sources)
    if tuple(t.shape) != (d,):
        raise ValueError(f"{name} must have shape ({d},) for sources of width d = {d}, got {tuple(t.shape)}")


def resolve(sources, partial, branch, query, weight, *, scale, key_eps, eps, normed_values, kind,
            form="fused") -> AttnResSpec:
    """Validate every argument of one call and return its spec."""
    check_tensor("sources", sources)
    if sources.dim() < 2:
        raise ValueError(f"sources must have shape (..., S, d), at least 2 dims, got {tuple(sources.shape)}")
    nb, d = sources.shape[-2], sources.shape[-1]
    if d < 1:
        raise ValueError("sources' last dim d must be >= 1")
    update = branch is not None
    s = nb + (1 if update else 0)
    if nb < 1:
        raise ValueError(f"sources' count S = shape[-2] must be >= 1 (a bank of at least one state), got {nb}")
    if s > MAX_SOURCES:
        extra = " (the partial' counted as one more)" if update else ""
        raise ValueError(f"sources' count S = shape[-2] must be in 1..{MAX_SOURCES}{extra}, got {s}")
    if not isinstance(kind, str) or kind != "rms":
        raise ValueError(f"kind must be 'rms' (the next sublayer's RMS norm), got {kind!r}")
    if not isinstance(form, str) or form not in FORMS:
        raise ValueError(f"form must be one of {sorted(FORMS)}, got {form!r}")
    if not isinstance(normed_values, bool):
        raise TypeError(f"normed_values must be a bool, got {type(normed_values).__name__}")
    check_number("scale", scale)
    check_number("key_eps", key_eps)
    if key_eps < 0:
        raise ValueError(f"key_eps must be >= 0, got {key_eps}")
    check_eps(eps)
    _check_vector("query", query, sources, d)
    if weight is not None:
        _check_vector("weight", weight, sources, d)
    if has_dtensor(sources, partial, branch, query, weight):
        raise TypeError("attn_res_norm takes no DTensors yet: pass each rank's local tensors (to_local())")
    lead = tuple(sources.shape[:-2]) + (d,)
    if update:
        for name, t in (("branch", branch), ("partial", partial)):
            if t is None:
                continue
            check_tensor(name, t, sources)
            if tuple(t.shape) != lead:
                raise ValueError(f"{name} must have shape {lead} (sources' leading dims, then d), "
                                 f"got {tuple(t.shape)}")
    elif partial is not None:
        raise ValueError("partial applies only with a branch to add (branch is None)")
    return AttnResSpec(s=s, d=d, update=update, has_partial=partial is not None, normed_values=normed_values,
                       scale=float(scale), key_eps=float(key_eps), eps=float(eps), form=FORMS[form])


def apply(sources, partial, branch, query, weight, spec: AttnResSpec):
    """(y, mixed, partial' or None) on validated arguments: the kernels or the torch path."""
    if not uses_triton(sources) or func_transforms_active():
        return attn_res_reference.attn_res_fwd(sources, partial, branch, query, weight, spec)
    y, mixed, pn, _, _, _ = attn_res_op(sources, partial, branch, query, weight, spec.pack())
    return y, mixed, pn if spec.update else None


# ---------------------------------------------------------------- the kernel path's custom ops
# Absent tensors cross the op boundary as empty placeholders (custom ops return no None).
def _fwd(sources: Tensor, partial: Optional[Tensor], branch: Optional[Tensor], query: Tensor,
         weight: Optional[Tensor], spec: List[float]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # noqa: UP006
    out = kernels("attn_res", sources).attn_res_fwd(sources, partial, branch, query, weight,
                                                    AttnResSpec.unpack(spec))
    return placeholders(sources, out)


def _fwd_fake(sources, partial, branch, query, weight, spec):
    s = AttnResSpec.unpack(spec)
    lead = sources.shape[:-2]
    rows = sources.numel() // (s.bank * s.d) if s.d else 0
    return (
        sources.new_empty((*lead, s.d)),
        sources.new_empty((*lead, s.d)),
        sources.new_empty((*lead, s.d)) if s.update else sources.new_empty(0, dtype=torch.float32),
        sources.new_empty((rows, s.s), dtype=torch.float32),
        sources.new_empty((rows, s.s), dtype=torch.float32),
        sources.new_empty((rows,), dtype=torch.float32),
    )


def _bwd(dy: Optional[Tensor], dmixed: Optional[Tensor], dpn: Optional[Tensor], sources: Tensor,
         pn: Optional[Tensor], query: Tensor, weight: Optional[Tensor], a: Tensor, r: Tensor, rho: Tensor,
         spec: List[float]) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # noqa: UP006
    grads = kernels("attn_res", sources).attn_res_bwd(dy, dmixed, dpn, sources, pn, query, weight, a, r, rho,
                                                      AttnResSpec.unpack(spec))
    return placeholders(sources, grads)


def _bwd_fake(dy, dmixed, dpn, sources, pn, query, weight, a, r, rho, spec):
    s = AttnResSpec.unpack(spec)
    return (torch.empty_like(sources, memory_format=torch.contiguous_format),
            torch.empty_like(pn) if s.update else sources.new_empty(0, dtype=torch.float32),
            torch.empty_like(query),
            torch.empty_like(weight) if weight is not None else sources.new_empty(0, dtype=torch.float32))


def _setup(ctx, inputs, output):
    sources, partial, branch, query, weight, spec = inputs
    _, _, pn, a, r, rho = output
    ctx.spec = AttnResSpec.unpack(spec)
    # the sources, partial' (an output, the next call's input) and per token S softmax
    # weights, S key statistics and the mix's rstd: no stacked copy, no keys, no mix
    ctx.save_for_backward(sources, pn if ctx.spec.update else None, query, weight, a, r, rho)
    ctx.present = (partial is not None, branch is not None, weight is not None)


def _grads(ctx, grad_outputs, bwd):
    dy, dmixed, dpn = grad_outputs[:3]
    spec = ctx.spec
    sources, pn, query, weight, a, r, rho = ctx.saved_tensors
    dsrc, dp, dq, dw = bwd(dy, dmixed, dpn if spec.update else None, sources, pn, query, weight, a, r, rho,
                           spec.pack())
    has_p, has_b, has_w = ctx.present
    return dsrc, dp if has_p else None, dp if has_b else None, dq, dw if has_w else None


attn_res_op = FusedOp("attn_res", _fwd, _fwd_fake, _bwd, _bwd_fake, _setup, _grads, stats=(3, 4, 5))


def attn_res_norm(sources: Tensor, query: Tensor, weight: Tensor | None, *, scale: float = 1.0,
                  key_eps: float = 1e-6, eps: float = 1e-6, normed_values: bool = False,
                  kind: str = "rms", form: str = "fused") -> tuple[Tensor, Tensor]:
    """An attention residual: a learned softmax mix over S source states, then the next norm.

    sources (..., S, d), 1 <= S <= 16, any strides (a bank of S states per token, not a
    stacked copy); query (d,); weight (d,) or None. Per token

        k_j = v_j rsqrt(mean(v_j^2) + key_eps),  a = softmax_j(scale (query . k_j))
        mixed = sum_j a_j (k_j if normed_values else v_j)
        y = rms_norm(mixed, weight, eps)        (mixed rounded to sources' dtype first)

    Returns (y, mixed), both in sources' dtype. Kimi's Attention Residuals mix the states
    (normed_values=False, scale=1); transformers' inkling2_loop the keys (normed_values=True,
    scale=d**-0.5).

    form ("fused", "inkling2") picks the torch path's order of operations: fuseblock's own,
    or that of transformers' Inkling2BlockAttentionResidual (two batched matmuls), which
    that path then reproduces bit for bit in fp32; the kernels keep their one order.
    """
    spec = resolve(sources, None, None, query, weight, scale=scale, key_eps=key_eps, eps=eps,
                   normed_values=normed_values, kind=kind, form=form)
    y, mixed, _ = apply(sources, None, None, query, weight, spec)
    return y, mixed


def attn_res_add_norm(sources: Tensor, branch: Tensor, partial: Tensor | None, query: Tensor,
                      weight: Tensor | None, *, scale: float = 1.0, key_eps: float = 1e-6, eps: float = 1e-6,
                      normed_values: bool = False, kind: str = "rms",
                      form: str = "fused") -> tuple[Tensor, Tensor, Tensor]:
    """`attn_res_norm` with the block's running partial state updated in the same launch.

    sources (..., S - 1, d): the finished blocks' states; branch (..., d): the last
    sublayer's output; partial (..., d) the running partial block, or None at a block's
    first sublayer. partial' = partial + branch (branch alone without partial), rounded
    to sources' dtype, is the S-th source. Returns (y, mixed, partial'). form as attn_res_norm's.
    """
    spec = resolve(sources, partial, branch, query, weight, scale=scale, key_eps=key_eps, eps=eps,
                   normed_values=normed_values, kind=kind, form=form)
    return apply(sources, partial, branch, query, weight, spec)
