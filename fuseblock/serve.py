"""The serving contract: vLLM's in-place norm entry points, on the training op's kernels.

    fused_add_rms_norm(input, residual, weight, eps)        residual <- input + residual
                                                             input    <- rms_norm(residual) * weight
    rms_norm(out, input, weight, eps)                       out      <- rms_norm(input) * weight
    fused_add_layer_norm(input, residual, weight, bias, eps)   as above, a layer norm
    layer_norm(out, input, weight, bias, eps)

Each takes `weight_offset=` (Gemma's 1 + w, added in fp32) and returns None. The bits are
the training op's forward (`fuseblock.add_norm(input, residual, weight, eps=eps,
residual_dtype=residual.dtype)`), so a trainer and an inference server using fuseblock
agree on every logit; and the kernels are batch invariant (a row's bits do not depend on
the other rows of the call: tests/ops/test_batch_invariance.py).

On the kernel path (CUDA tensors, or CPU under TRITON_INTERPRET=1) a call is one launch
of the forward kernel writing straight into `input`/`residual`/`out`: no autograd, no
statistics kept, nothing allocated, no host sync, so it may be captured in a CUDA graph.
What is validated per shape is kept (`_SPECS`); a call then checks only what a caller can
change between calls of one shape (devices, dtypes, shapes, strides, storage overlap).

Memory: rows are passed by stride (any row stride, unit column stride); `out` may be
`input` itself (an in-place norm). Any other overlap is refused (ValueError): `input`
and `residual` must not share memory, nor `out` and `input` in part, since a kernel
program would read what another already wrote; nor may a written tensor overlap itself
(an expanded residual, input or out: every token would add into one row). No argument may require grad while grad
mode is on (these entries bypass autograd: use `fuseblock.add_norm` to train).

On the torch path (other CPU calls) the same contract is met by the training op followed
by copies: the same bits, but allocating, as any eager torch op does.

Under torch.compile (fullgraph too, as vLLM compiles the whole model) each call is one op
of the graph, the custom op `fuseblock::serve_add_norm` (mutating input and residual) or
`serve_norm` (mutating out), which runs the eager call, checks included, on the real tensors.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .ops.checks import check_number, check_tensor, resolve
from .ops.dispatch import kernels, uses_triton
from .ops.norm import add_norm
from .spec import DEFAULT_GATE_ACT, DEFAULT_GATE_POSITION, NormSpec

__all__ = ["fused_add_rms_norm", "rms_norm", "fused_add_layer_norm", "layer_norm"]

_SPECS: dict[tuple, NormSpec] = {}  # (kind, eps, weight_offset, d, dtypes) -> the validated spec


def _span(t: Tensor) -> tuple[int, int]:
    """[first, last) byte addresses t's elements occupy (strides >= 0)."""
    start = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _overlap(a: Tensor, b: Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _self_overlap(t: Tensor) -> bool:
    """Whether two of t's elements share memory (an expanded, stride-0 tensor; rows whose
    stride is shorter than a row): each dim's stride must pass the extent of the dims with
    smaller strides. Sizes and strides only: no tensor op (a call dispatches none)."""
    extent = 1
    for s, n in sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1):
        if s < extent:
            return True
        extent += (n - 1) * s
    return False


def _same(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _check_act(name: str, t, x: Tensor) -> None:
    check_tensor(name, t, x)
    if t.shape != x.shape:
        raise ValueError(f"{name} must have input's shape {tuple(x.shape)}, got {tuple(t.shape)}")
    if t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a unit stride in its last dim (got strides {t.stride()})")


def _rows(name: str, t: Tensor) -> Tensor:
    """(M, d) view with no copy, or a ValueError naming the argument."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name}'s rows cannot be viewed as (rows, d) without a copy (strides {t.stride()}): "
                         "pass a tensor whose leading dims can be flattened") from None


def _spec(kind, x, residual, weight, bias, eps, weight_offset) -> NormSpec:
    key = (kind, eps, weight_offset, x.shape[-1] if x.dim() else None, x.dtype, x.device.type,
           None if residual is None else residual.dtype, None if weight is None else (weight.dtype, weight.shape),
           None if bias is None else (bias.dtype, bias.shape))
    spec = _SPECS.get(key)
    if spec is None:
        check_number("eps", eps)
        check_number("weight_offset", weight_offset)
        spec = resolve(x, residual, weight, bias, None, kind=kind, c=None, eps=float(eps),
                       gate_act=DEFAULT_GATE_ACT, gate_position=DEFAULT_GATE_POSITION, num_groups=1,
                       residual_dtype=None if residual is None else residual.dtype,
                       weight_offset=float(weight_offset))
        _SPECS[key] = spec
    return spec


def _check(kind, out, x, residual, weight, bias, eps, weight_offset) -> NormSpec:
    check_tensor("input", x)
    if x.dim() == 0:
        raise ValueError("input must have at least one dimension (the normalized last dim)")
    spec = _spec(kind, x, residual, weight, bias, eps, weight_offset)  # names a bad weight, bias, residual dtype
    for name, t in (("out", out), ("residual", residual)):
        if t is not None:
            _check_act(name, t, x)
    _check_act("input", x, x)
    if out is not None and out.dtype != x.dtype:
        raise ValueError(f"out must have input's dtype {x.dtype}, got {out.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on input's device {x.device}, got {t.device}")
        if t is not None and t.stride(0) != 1 and t.numel() > 1:
            raise ValueError(f"{name} must be contiguous (got stride {t.stride(0)})")
    for name, t in (("out", out), ("residual", residual), ("input", x if out is None else None)):  # those written
        if t is not None and _self_overlap(t):
            raise ValueError(f"{name} overlaps itself (shape {tuple(t.shape)}, strides {t.stride()}): it is written, "
                             "and tokens would write the same memory; pass a tensor of distinct elements "
                             "(an expanded tensor's .contiguous())")
    if residual is not None and _overlap(x, residual):
        raise ValueError("input and residual must not share memory: fused_add_*_norm writes both")
    if out is not None and not _same(out, x) and _overlap(out, x):
        raise ValueError("out overlaps input in part: pass input itself (an in-place norm) or a separate tensor")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (out, x, residual, weight, bias)):
        raise ValueError("fuseblock.serve entries have no autograd: call them under torch.no_grad() or "
                         "torch.inference_mode(), or train with fuseblock.add_norm")
    return spec


def _run(kind, out, x, residual, weight, bias, eps, weight_offset) -> None:
    spec = _check(kind, out, x, residual, weight, bias, eps, weight_offset)
    dst = x if out is None else out  # fused_add_*: input receives the normed output
    if not uses_triton(x):  # the torch path: the training op's own forward, then copies
        with torch.no_grad():
            y, new_res = add_norm(x, residual, weight, bias, kind=kind, eps=spec.eps, weight_offset=spec.weight_offset,
                                  residual_dtype=None if residual is None else residual.dtype)
            if residual is not None:
                residual.copy_(new_res)
            dst.copy_(y)
        return
    if x.numel() == 0:
        return
    x2 = _rows("input", x)
    r2 = None if residual is None else _rows("residual", residual)
    # out and new_residual written where they are read: each row is read whole (or, wider
    # than a tile, each chunk) before the kernel writes it (fuseblock.kernels.norm)
    kernels("norm", x).norm_fwd(x2, r2, None, weight, bias, spec, None if r2 is None else r2.dtype, False,
                                out=_rows("out" if out is not None else "input", dst), new_res=r2)


# What a compiled graph holds (torch.compile, vLLM's whole-graph capture): one op per call,
# declaring the tensors it writes, run as the eager entries run (with their checks, on the
# real tensors). Eager calls skip the op's dispatch: they call `_run` directly.
@torch.library.custom_op("fuseblock::serve_add_norm", mutates_args=("input", "residual"))
def _add_norm_op(input: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str,
                 eps: float, weight_offset: float) -> None:
    _run(kind, None, input, residual, weight, bias, eps, weight_offset)


@_add_norm_op.register_fake
def _(input, residual, weight, bias, kind, eps, weight_offset) -> None:
    return None


@torch.library.custom_op("fuseblock::serve_norm", mutates_args=("out",))
def _norm_op(out: Tensor, input: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str, eps: float,
             weight_offset: float) -> None:
    _run(kind, out, input, None, weight, bias, eps, weight_offset)


@_norm_op.register_fake
def _(out, input, weight, bias, kind, eps, weight_offset) -> None:
    return None


def _add_norm(kind, x, residual, weight, bias, eps, weight_offset) -> None:
    check_tensor("residual", residual)
    if torch.compiler.is_compiling():
        _add_norm_op(x, residual, weight, bias, kind, eps, weight_offset)
    else:
        _run(kind, None, x, residual, weight, bias, eps, weight_offset)


def _norm(kind, out, x, weight, bias, eps, weight_offset) -> None:
    check_tensor("out", out)
    if torch.compiler.is_compiling():
        _norm_op(out, x, weight, bias, kind, eps, weight_offset)
    else:
        _run(kind, out, x, None, weight, bias, eps, weight_offset)


def fused_add_rms_norm(input: Tensor, residual: Tensor, weight: Tensor | None, eps: float, *,
                       weight_offset: float = 0.0) -> None:
    """vLLM's fused_add_rms_norm: residual <- input + residual (in residual's dtype), then
    input <- rms_norm(residual) * (weight_offset + weight). In place; returns None."""
    _add_norm("rms", input, residual, weight, None, eps, weight_offset)


def rms_norm(out: Tensor, input: Tensor, weight: Tensor | None, eps: float, *, weight_offset: float = 0.0) -> None:
    """vLLM's rms_norm: out <- rms_norm(input) * (weight_offset + weight). out may be input."""
    _norm("rms", out, input, weight, None, eps, weight_offset)


def fused_add_layer_norm(input: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, *,
                         weight_offset: float = 0.0) -> None:
    """fused_add_rms_norm's layer norm: residual <- input + residual, input <- layer_norm(residual)."""
    _add_norm("layer", input, residual, weight, bias, eps, weight_offset)


def layer_norm(out: Tensor, input: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, *,
               weight_offset: float = 0.0) -> None:
    """rms_norm's layer norm: out <- layer_norm(input) * (weight_offset + weight) + bias."""
    _norm("layer", out, input, weight, bias, eps, weight_offset)
