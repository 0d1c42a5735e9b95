"""The hyper-connection (mHC) boundary ops: `hc_add_norm`, `hc_norm` and `hc_head`.

Validation into a `HyperSpec` (once per call), then dispatch as for the other ops
(`fuseblock.ops.dispatch`): the Triton kernels (`fuseblock.kernels.hyper`, one launch
forward, registered as custom ops with their backward), or the torch path
(`fuseblock.reference.hyper`), plain differentiable torch ops. The math is in
`fuseblock.hyper_spec` and docs/stream.md.
"""
# No `from __future__ import annotations`: the custom ops' schemas are read from the annotations
from typing import List, Optional

import torch
from torch import Tensor

from ..hyper_spec import FORMS, HyperSpec, Mode
from ..reference import hyper as hyper_reference
from . import dtensor
from .checks import check_eps, check_int, check_number, check_tensor
from .dispatch import func_transforms_active, kernels, uses_triton
from .dtensor import has_dtensor
from .registry import FusedOp, placeholder, placeholders

MAX_STREAMS = 16


def _check_shape(name: str, t, shape: tuple, streams: Tensor) -> None:
    check_tensor(name, t, streams)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def resolve(streams, branch, post, comb, fn, base, scale, weight, *, iters, hc_eps, eps, kind, post_mult, post_eps,
            form, head: bool) -> HyperSpec:
    """Validate every argument of one boundary and return its spec."""
    check_tensor("streams", streams)
    if streams.dim() < 2:
        raise ValueError(f"streams must have shape (..., n, d), at least 2 dims, got {tuple(streams.shape)}")
    n, d = streams.shape[-2], streams.shape[-1]
    if not 1 <= n <= MAX_STREAMS:
        raise ValueError(f"streams' stream count n = shape[-2] must be in 1..{MAX_STREAMS}, got {n}")
    if d < 1:
        raise ValueError("streams' last dim d must be >= 1")
    if not isinstance(kind, str) or kind != "rms":
        raise ValueError(f"kind must be 'rms' (every mHC family normalizes so), got {kind!r}")
    if not isinstance(form, str) or form not in FORMS:
        raise ValueError(f"form must be one of {sorted(FORMS)}, got {form!r}")
    check_int("iters", iters)
    check_number("hc_eps", hc_eps)
    if hc_eps < 0:
        raise ValueError(f"hc_eps must be >= 0, got {hc_eps}")
    check_eps(eps)
    check_number("post_mult", post_mult)
    check_number("post_eps", post_eps)
    lead = tuple(streams.shape[:-2])
    update = branch is not None
    if update:
        _check_shape("branch", branch, lead + (d,), streams)
        if post is None:
            raise ValueError("post must be given with branch: H' = post (x) branch + comb^T H")
        _check_shape("post", post, lead + (n,), streams)
        if comb is not None:
            _check_shape("comb", comb, lead + (n, n), streams)
    elif post is not None or comb is not None:
        raise ValueError("post and comb apply only with a branch to add (branch is None)")
    if fn is None:
        if not head:
            raise ValueError("fn must be a tensor of shape (m, n*d) (None only for hc_head's mean)")
        if base is not None or scale is not None:
            raise ValueError("base and scale apply only with fn (fn is None: the head is the streams' mean)")
        mode = Mode.MEAN_HEAD
    else:
        check_tensor("fn", fn, streams)
        ms = (n,) if head else (2 * n + n * n, 2 * n)
        if fn.dim() != 2 or fn.shape[1] != n * d or fn.shape[0] not in ms:
            want = " or ".join(f"({m}, {n * d})" for m in ms)
            raise ValueError(f"fn must have shape {want} for streams of n={n}, d={d}, got {tuple(fn.shape)}")
        m = fn.shape[0]
        mode = Mode.HEAD if head else (Mode.PRE_POST_COMB if m == 2 * n + n * n else Mode.PRE_POST)
        _check_shape("base", base, (m,), streams)
        _check_shape("scale", scale, ((1,) if head else (3,) if mode == Mode.PRE_POST_COMB else (2,)), streams)
    if weight is not None:
        _check_shape("weight", weight, (d,), streams)
    return HyperSpec(n=n, d=d, mode=mode, update=update, comb_in=comb is not None, iters=int(iters),
                     hc_eps=float(hc_eps), eps=float(eps), post_mult=float(post_mult), post_eps=float(post_eps),
                     form=FORMS[form])


def apply(streams, branch, post, comb, fn, base, scale, weight, spec: HyperSpec):
    """(y, new_streams, post_next, comb_next) on validated arguments: the kernels or the torch path
    (on DTensors, on each rank's tokens: fuseblock.ops.dtensor.hyper)."""
    if has_dtensor(streams, branch, fn, weight, post, comb):
        return dtensor.hyper(lambda *local: _local(*local, spec), streams, branch, post, comb, fn, base, scale,
                             weight)
    return _local(streams, branch, post, comb, fn, base, scale, weight, spec)


def _local(streams, branch, post, comb, fn, base, scale, weight, spec: HyperSpec):
    """`apply` on plain tensors."""
    if not uses_triton(streams) or func_transforms_active():
        return hyper_reference.hyper_fwd(streams, branch, post, comb, fn, base, scale, weight, spec)
    y, hn, post_n, comb_n, _, _ = hc_op(streams, branch, post, comb, fn, base, scale, weight, spec.pack())
    post_out = spec.mode in (Mode.PRE_POST_COMB, Mode.PRE_POST)
    return (y, hn if spec.update else streams, post_n if post_out else None,
            comb_n if spec.mode == Mode.PRE_POST_COMB else None)


# ---------------------------------------------------------------- the kernel path's custom ops
# Absent tensors cross the op boundary as empty placeholders (custom ops return no None).
def _fwd(streams: Tensor, branch: Optional[Tensor], post: Optional[Tensor], comb: Optional[Tensor],
         fn: Optional[Tensor], base: Optional[Tensor], scale: Optional[Tensor], weight: Optional[Tensor],
         spec: List[float]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # noqa: UP006
    out = kernels("hyper", streams).hyper_fwd(streams, branch, post, comb, fn, base, scale, weight,
                                               HyperSpec.unpack(spec))
    return placeholders(streams, out)


def _fwd_fake(streams, branch, post, comb, fn, base, scale, weight, spec):
    s = HyperSpec.unpack(spec)
    lead, acc = streams.shape[:-2], torch.float64 if streams.dtype == torch.float64 else torch.float32
    rows = streams.numel() // (s.n * s.d)
    return (
        streams.new_empty((*lead, s.d), dtype=s.y_dtype(streams, weight)),
        streams.new_empty(streams.shape) if s.update else placeholder(streams),
        streams.new_empty((*lead, s.n), dtype=acc) if s.mode in (Mode.PRE_POST_COMB, Mode.PRE_POST)
        else placeholder(streams),
        streams.new_empty((*lead, s.n, s.n), dtype=acc) if s.mode == Mode.PRE_POST_COMB else placeholder(streams),
        streams.new_empty((rows, s.m), dtype=torch.float32),
        streams.new_empty((rows,), dtype=torch.float32),
    )


def _bwd(dy: Optional[Tensor], dhn: Optional[Tensor], dpost_n: Optional[Tensor], dcomb_n: Optional[Tensor],
         streams: Tensor, branch: Optional[Tensor], post: Optional[Tensor], comb: Optional[Tensor],
         hn: Optional[Tensor], fn: Optional[Tensor], base: Optional[Tensor], scale: Optional[Tensor],
         weight: Optional[Tensor], mix: Tensor, rho: Tensor, spec: List[float],  # noqa: UP006
         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = kernels("hyper", streams).hyper_bwd(dy, dhn, dpost_n, dcomb_n, streams, branch, post, comb, hn, fn,
                                                 base, scale, weight, mix, rho, HyperSpec.unpack(spec))
    return placeholders(streams, grads)


def _bwd_fake(dy, dhn, dpost_n, dcomb_n, streams, branch, post, comb, hn, fn, base, scale, weight, mix, rho, spec):
    return tuple(t.new_empty(t.shape) if t is not None else placeholder(streams)  # contiguous, as the kernels'
                 for t in (streams, branch, post, comb, fn, base, scale, weight))


def _setup(ctx, inputs, output):
    streams, branch, post, comb, fn, base, scale, weight, spec = inputs
    _, hn, _, _, mix, rho = output
    ctx.spec = HyperSpec.unpack(spec)
    # H' (an output, the next boundary's input) and the per-token mix and rho: no (m, n*d)
    # intermediate, no normalized row; the Sinkhorn passes are recomputed
    ctx.save_for_backward(streams, branch, post, comb, hn if ctx.spec.update else None, fn, base, scale, weight,
                          mix, rho)
    ctx.present = tuple(t is not None for t in (branch, post, comb, fn, base, scale, weight))


def _grads(ctx, grad_outputs, bwd):
    dy, dhn, dpost_n, dcomb_n = grad_outputs[:4]
    spec = ctx.spec
    streams, branch, post, comb, hn, fn, base, scale, weight, mix, rho = ctx.saved_tensors
    got = bwd(dy, dhn if spec.update else None,
              dpost_n if spec.mode in (Mode.PRE_POST_COMB, Mode.PRE_POST) else None,
              dcomb_n if spec.mode == Mode.PRE_POST_COMB else None,
              streams, branch, post, comb, hn, fn, base, scale, weight, mix, rho, spec.pack())
    return (got[0], *(g if present else None for g, present in zip(got[1:], ctx.present, strict=True)))


hc_op = FusedOp("hc", _fwd, _fwd_fake, _bwd, _bwd_fake, _setup, _grads, stats=(4, 5))


def hc_add_norm(streams: Tensor, branch: Tensor, post: Tensor, comb: Tensor | None, fn: Tensor, base: Tensor,
                scale: Tensor, weight: Tensor | None, *, iters: int = 20, hc_eps: float = 1e-6,
                eps: float = 1e-6, kind: str = "rms", post_mult: float = 2.0, post_eps: float = 0.0,
                form: str = "fused") -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One hyper-connection boundary: the update, the next sublayer's coefficients, its input.

    streams (..., n, d): the n residual streams; branch (..., d): the sublayer's output f;
    post (..., n) and comb (..., n, n) (or None: HY-V4's form): the coefficients the last
    boundary returned. Then

        H' = post (x) f + comb^T H  (comb None: H + post (x) f), stored in streams' dtype
        mix = rsqrt(mean(flat(H')^2) + eps) * (fn . flat(H'))      fn: (m, n*d), m = 2n + n^2 or 2n
        pre = sigmoid(mix_pre * scale[0] + base_pre) + hc_eps
        post_next = post_mult * sigmoid(mix_post * scale[1] + base_post) + post_eps
        comb_next = Sinkhorn(softmax_rows(mix_comb * scale[2] + base_comb) + hc_eps, iters)  (m = 2n + n^2)
        y = rms_norm(sum_i pre_i H'_i, weight, eps)    (the collapse rounded to streams' dtype first)

    Returns (y, new_streams, post_next, comb_next): y and new_streams in streams' dtype
    (y with form "hy_v4" or "glm5_next": in the promotion of the streams' and the weight's,
    as their modeling code's RMSNorm returns it: fp32 for bf16 streams with an fp32 weight,
    on both paths), post_next and comb_next in fp32 (fp64 for fp64 streams); comb_next None
    where m = 2n.
    base (m,), scale (3,) or (2,): as DeepSeek-V4's and HY-V4's HyperConnection hold them.
    DeepSeek-V4 and GLM-5-next: post_mult=2, post_eps=0; HY-V4: post_mult=hc_magnitude,
    post_eps=hc_eps, no comb. `form` ("fused", "deepseek_v4", "hy_v4", "glm5_next") picks
    the torch path's order of operations, to equal that family's modeling code bit for bit
    (fuseblock.reference.hyper); the kernels compute the same math in their own order.
    """
    spec = resolve(streams, branch, post, comb, fn, base, scale, weight, iters=iters, hc_eps=hc_eps, eps=eps,
                   kind=kind, post_mult=post_mult, post_eps=post_eps, form=form, head=False)
    return apply(streams, branch, post, comb, fn, base, scale, weight, spec)


def hc_norm(streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, weight: Tensor | None, *, iters: int = 20,
            hc_eps: float = 1e-6, eps: float = 1e-6, kind: str = "rms", post_mult: float = 2.0,
            post_eps: float = 0.0, form: str = "fused") -> tuple[Tensor, Tensor, Tensor | None]:
    """The first boundary (no branch to add): `hc_add_norm` without the update.
    Returns (y, post_next, comb_next)."""
    spec = resolve(streams, None, None, None, fn, base, scale, weight, iters=iters, hc_eps=hc_eps, eps=eps,
                   kind=kind, post_mult=post_mult, post_eps=post_eps, form=form, head=False)
    y, _, post_next, comb_next = apply(streams, None, None, None, fn, base, scale, weight, spec)
    return y, post_next, comb_next


def hc_head(streams: Tensor, fn: Tensor | None, base: Tensor | None, scale: Tensor | None,
            weight: Tensor | None, *, branch: Tensor | None = None, post: Tensor | None = None,
            comb: Tensor | None = None, hc_eps: float = 1e-6, eps: float = 1e-6, kind: str = "rms",
            form: str = "fused") -> tuple[Tensor, Tensor]:
    """The head: collapse the streams with the head's own pre, then the final norm.

    pre = sigmoid(rsqrt(mean(flat(H)^2) + eps) * (fn . flat(H)) * scale + base) + hc_eps
    with fn (n, n*d), base (n,), scale (1,) (DeepSeek-V4's and HY-V4's HyperHead), and
    y = rms_norm(sum_i pre_i H_i, weight, eps). fn = base = scale = None: the streams'
    mean (GLM-5-next's head). branch, post, comb: the last layer's update, fused in
    (H = post (x) branch + comb^T streams first). Returns (y, new_streams): new_streams is
    `streams` itself without a branch.
    """
    spec = resolve(streams, branch, post, comb, fn, base, scale, weight, iters=1, hc_eps=hc_eps, eps=eps,
                   kind=kind, post_mult=1.0, post_eps=0.0, form=form, head=True)
    y, new_streams, _, _ = apply(streams, branch, post, comb, fn, base, scale, weight, spec)
    return y, new_streams
