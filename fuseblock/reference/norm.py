"""The pure-PyTorch path of the normalize op family: the math as plain differentiable torch ops.

Same forward contract as the Triton launchers in `fuseblock.kernels.norm`. autograd
differentiates these ops, as it would the naive form's (the full backward, which the
kernels implement, is derived in docs/math.md). It runs wherever the kernels do not, and
serves the kernels' double backward. One backward is written out, `norm_grads`: for a
caller that keeps no graph of the norm, only p and its row statistics
(fuseblock.norm_linear). Symbols follow docs/math.md:

    p = x + residual               (the residual sum, stored as new_residual)
    s = p * g(z)     (pre-gate)    or  s = p         (z: the gate tensor)
    q = s - mean(s)  (layer)       or  q = s
    sigma = sqrt(q.q/d + eps),  r = q / sigma
    o1 = scale * r * (w0 + w) + b  (scale = c / sqrt(d), w0 = weight_offset)
    o = o1 * g(z)    (post-gate)   or  o = o1

d is the size of one normalized group (the whole row unless num_groups > 1).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..spec import Act, Gate, NormSpec, acc_dtype


def gate_act(z: Tensor, act: Act) -> Tensor:
    """g(z)."""
    if act == Act.IDENTITY:
        return z
    if act == Act.SIGMOID:
        return torch.sigmoid(z)
    if act == Act.SILU:
        return torch.nn.functional.silu(z)
    raise ValueError(f"unknown gate activation {act!r}")


def _grouped(t: Tensor, groups: int) -> Tensor:
    return t.reshape(-1, groups, t.shape[-1] // groups)  # (M, G, d/G) for any leading shape


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t in dtype; no call into torch when it already is (the eager torch path's host time
    is what a small call costs)."""
    return t if t.dtype == dtype else t.to(dtype)


def _weight(weight: Tensor | None, spec: NormSpec, dtype: torch.dtype) -> Tensor | None:
    """weight_offset + weight in the accumulation dtype (the sum is never rounded to the weight's)."""
    if weight is None:
        return None
    w = _as(weight, dtype)
    return w + spec.weight_offset if spec.weight_offset != 0.0 else w


def affine(r: Tensor, spec: NormSpec, weight, bias) -> Tensor:
    """o1 = scale * r * (weight_offset + weight) + bias, in r's dtype."""
    o1 = r * spec.scale if spec.scale != 1.0 else r  # c = sqrt(d) (rms, layer): scale 1, no pass over r
    if weight is not None:
        o1 = o1 * _weight(weight, spec, r.dtype)
    if bias is not None:
        o1 = o1 + bias.to(r.dtype)
    return o1


# ---------------------------------------------------------------- the plain fast path
# Where the spec is a plain RMS or layer norm (no gate, one group, eps > 0) on an fp32 or
# fp64 p, the torch path is exactly the naive form's ops: F.rms_norm / F.layer_norm,
# which autograd, torch.func and Inductor all know. The scale c/sqrt(d) and the weight
# offset fold into the weight they are given.
def plain_ok(p: Tensor, spec: NormSpec) -> bool:
    """Whether the norm of p is a plain RMS or layer norm that torch's own ops compute."""
    return p.dtype in (torch.float32, torch.float64) and spec.gate == Gate.NONE and spec.groups == 1 and spec.eps > 0


def plain_weight(weight: Tensor | None, spec: NormSpec, like: Tensor) -> Tensor | None:
    """The weight torch's norm ops take: scale * (weight_offset + weight), in like's dtype."""
    w = _weight(weight, spec, like.dtype)
    if spec.scale == 1.0:
        return w
    return torch.full(like.shape[-1:], spec.scale, dtype=like.dtype, device=like.device) if w is None \
        else w * spec.scale


def _rms_norm_body():
    """torch.rms_norm's own body, `(out, rstd) = torch._fused_rms_norm(p, shape, w, eps)`,
    where this torch has the one rms_norm calls on every device (torch >= 2.9). Called
    directly it runs the same ops one dispatcher hop sooner: 0.8 us of a 1 x 1024 call's
    host time on the CPU. Eager only: torch.compile traces rms_norm, not its body."""
    op = getattr(torch.ops.aten, "_fused_rms_norm", None)
    schema = ("aten::_fused_rms_norm(Tensor input, int[] normalized_shape, Tensor? weight, float? eps)"
              " -> (Tensor, Tensor)")
    if op is not None and str(op.default._schema) == schema:
        return torch._fused_rms_norm
    return lambda p, shape, weight, eps: (torch.rms_norm(p, shape, weight, eps), None)


RMS_NORM_BODY = _rms_norm_body()


def plain_norm(p: Tensor, weight: Tensor | None, bias: Tensor | None, center: bool, eps: float) -> Tensor:
    """torch's own norm of p over its last dim, weight and bias in p's dtype: layer_norm,
    or rms_norm and the bias added after it. torch.layer_norm and the rms_norm body are
    what F.layer_norm and F.rms_norm call, less their Python wrappers."""
    d = (p.shape[-1],)
    if center:
        return torch.layer_norm(p, d, weight, bias, eps)
    out = torch.rms_norm(p, d, weight, eps) if torch.compiler.is_compiling() else RMS_NORM_BODY(p, d, weight, eps)[0]
    return out if bias is None else out + bias


def _plain(p: Tensor, weight, bias, spec: NormSpec) -> Tensor:
    b = None if bias is None else _as(bias, p.dtype)
    return plain_norm(p, plain_weight(weight, spec, p), b, spec.center, spec.eps)


def _stats(s: Tensor, spec: NormSpec) -> tuple[Tensor, Tensor, Tensor | None]:
    """(q, rstd, mean) of s per group: q grouped (M, G, d/G), rstd and mean (M, G).

    Differentiable torch ops throughout, so double backward and torch.func see the math.
    """
    sg = _grouped(s, spec.groups)
    mean = None
    if spec.center:
        # Centre on each group's first element before summing: a constant group is then
        # exactly its value (q = 0, so out = bias), where a plain fp32 mean leaves a
        # remainder that rstd ~ 1/sqrt(eps) would amplify. Also less cancellation.
        # Detached: q does not depend on the shift at all, and through autograd the
        # shift's element would gather d gradient terms that cancel only in exact
        # arithmetic (1e-3 off at d = 131072 in fp32).
        shift = sg[..., :1].detach()
        cs = sg - shift
        dmean = cs.mean(-1, keepdim=True)
        mean = (shift + dmean).squeeze(-1)
        q = cs - dmean
    else:
        q = sg
    if spec.eps == 0:  # scale-safe: fp64 squares of any fp32 value neither underflow nor overflow
        rstd = torch.rsqrt(q.double().square().mean(-1)).to(q.dtype)
    else:
        rstd = torch.rsqrt(q.square().mean(-1) + spec.eps)
    return q, rstd, mean


def norm_out(p: Tensor, gate: Tensor | None, weight: Tensor | None, bias: Tensor | None, spec: NormSpec):
    """(out, rstd, mean) from p in p's (accumulation) dtype, as differentiable torch ops."""
    g = gate_act(gate.to(p.dtype), spec.act) if spec.gate != Gate.NONE else None
    s = p * g if spec.gate == Gate.PRE else p
    q, rstd, mean = _stats(s, spec)
    o = affine((q * rstd[..., None]).reshape(s.shape), spec, weight, bias)
    if spec.gate == Gate.POST:
        o = o * g
    return o, rstd, mean


def residual_sum(x: Tensor, residual: Tensor | None, residual_dtype: torch.dtype | None) -> Tensor | None:
    """new_residual = x + residual in residual_dtype (None: none is stored), rounded once
    from the exact sum."""
    if residual_dtype is None:
        return None
    if residual is None:
        return x.to(residual_dtype)
    if x.dtype == residual.dtype == residual_dtype:  # the naive form's one add
        return x + residual
    wide = torch.promote_types(torch.promote_types(x.dtype, residual.dtype), residual_dtype)
    return _as(_as(x, wide) + _as(residual, wide), residual_dtype)  # add in the widest of the three dtypes


def scaled(t: Tensor, scale, dtype: torch.dtype) -> Tensor:
    """t * scale in dtype: scale a float (1: t as it is) or a [d] tensor, cast to dtype."""
    if isinstance(scale, Tensor):
        return t * _as(scale, dtype)
    return t if scale == 1.0 else t * scale


def branch_sum(x: Tensor, x1: Tensor | None, residual: Tensor | None, residual_dtype: torch.dtype,
               spec: NormSpec, residual_scale: Tensor | None = None, branch_scale: Tensor | None = None) -> Tensor:
    """add_norm's branch: new_residual = a * residual + b * (drop(x) + drop(x1)) in
    residual_dtype, rounded once: the sum in fp32 (or the widest of the dtypes), torch's
    own dropout (independent masks for x and x1, from torch's generator). a and b: the
    [d] tensors residual_scale and branch_scale where given, else spec.residual_scale and
    spec.alpha."""
    wide = torch.promote_types(acc_dtype(x.dtype), residual_dtype)
    if residual is not None:
        wide = torch.promote_types(wide, residual.dtype)
    b = _as(x, wide)
    if spec.dropout_p > 0:
        b = torch.nn.functional.dropout(b, spec.dropout_p)
    if x1 is not None:
        b1 = _as(x1, wide)
        b = b + (torch.nn.functional.dropout(b1, spec.dropout_p) if spec.dropout_p > 0 else b1)
    b = scaled(b, spec.alpha if branch_scale is None else branch_scale, wide)
    if residual is not None:
        b = b + scaled(_as(residual, wide), spec.residual_scale if residual_scale is None else residual_scale, wide)
    return _as(b, residual_dtype)


def is_branch(spec: NormSpec, x1, residual_scale, branch_scale) -> bool:
    """Whether add_norm's call has a branch (new_residual is not the plain x + residual)."""
    return (x1 is not None or spec.alpha != 1.0 or spec.dropout_p > 0 or spec.residual_scale != 1.0
            or residual_scale is not None or branch_scale is not None)


def norm_fwd(
    x: Tensor,
    residual: Tensor | None,
    gate: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    spec: NormSpec,
    residual_dtype: torch.dtype | None,
    need_stats: bool,
    x1: Tensor | None = None,
    residual_scale: Tensor | None = None,
    branch_scale: Tensor | None = None,
):
    """The torch path: plain differentiable torch ops, so autograd (double backward
    included), torch.func and torch.compile see the math itself. Returns (out,
    new_residual or None, rstd (M, G) or None, mean (M, G) or None), like the Triton
    launchers.

    new_residual is formed only when residual_dtype is given (the caller passes it
    whenever there is a residual or a dtype change), rounded once from the exact sum; the
    norm then reads that stored value, as the naive stack's next layer would. x1 and
    spec.alpha, spec.dropout_p, spec.residual_scale and the [d] tensors residual_scale,
    branch_scale: add_norm's branch (`branch_sum`; residual_dtype given).
    """
    if is_branch(spec, x1, residual_scale, branch_scale):
        new_residual = branch_sum(x, x1, residual, residual_dtype, spec, residual_scale, branch_scale)
    else:
        new_residual = residual_sum(x, residual, residual_dtype)
    p = x if new_residual is None else new_residual
    out_dtype = spec.out_dtype_for(x.dtype)  # the fp32 result cast once, to x's dtype or out_dtype
    if not need_stats and plain_ok(p, spec):  # exactly the naive form's ops (see _plain)
        return _as(_plain(p, weight, bias, spec), out_dtype), new_residual, None, None
    # eps = 0, gates, groups, half-precision p: the composition, in fp32 (fp64 for fp64)
    out, rstd, mean = norm_out(p.to(acc_dtype(p.dtype)), gate, weight, bias, spec)
    if not need_stats:
        rstd = mean = None
    return out.to(out_dtype), new_residual, rstd, mean


# ---------------------------------------------------------------- a backward from statistics
# For a caller that runs the norm without a graph and differentiates it later from what it
# saved: p and the row statistics (fuseblock.norm_linear, which thus never keeps the
# normalized output). Ungated, one group.
def norm_and_stats(x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, spec: NormSpec,
                   residual_dtype: torch.dtype | None):
    """The norm with its row statistics: (out, new_residual or None, rstd (M, 1), mean
    (M, 1) or None, native). native: a plain layer norm ran torch.native_layer_norm, the
    naive form's own op, which returns them and whose backward takes them (one op each
    way, where the composition is a dozen on the CPU); else the composition of norm_out."""
    new_res = residual_sum(x, residual, residual_dtype)
    p = x if new_res is None else new_res
    if spec.center and plain_ok(p, spec):
        out, mean, rstd = torch.native_layer_norm(p, (p.shape[-1],), plain_weight(weight, spec, p),
                                                  None if bias is None else bias.to(p.dtype), spec.eps)
        return out.to(spec.out_dtype_for(x.dtype)), new_res, rstd.reshape(-1, 1), mean.reshape(-1, 1), True
    out, rstd, mean = norm_out(p.to(acc_dtype(p.dtype)), None, weight, bias, spec)
    return out.to(spec.out_dtype_for(x.dtype)), new_res, rstd, mean, False


def normalized(p: Tensor, rstd: Tensor, mean: Tensor | None, spec: NormSpec) -> Tensor:
    """r = q * rstd rebuilt from p and its saved row statistics (rstd, mean: (M, G)), in
    the accumulation dtype: one elementwise pass and no reduction, for a backward that
    did not keep the normalized output (fuseblock.norm_linear). Ungated specs (s = p)."""
    if spec.gate != Gate.NONE:
        raise ValueError("normalized: a gated norm's rows are p * g(gate); rebuild it with norm_out")
    pg = _grouped(_as(p, acc_dtype(p.dtype)), spec.groups)
    r = (pg - mean[..., None]).mul_(rstd[..., None]) if spec.center else pg * rstd[..., None]  # a fresh buffer
    return r.reshape(p.shape)


def norm_grads(do: Tensor, p: Tensor, r: Tensor | None, rstd: Tensor, mean: Tensor | None, weight, bias,
               spec: NormSpec, native: bool, need_w: bool, need_b: bool):
    """(dp, dweight, dbias) of the norm, in p's accumulation dtype, from the gradient `do`
    at its output (rows (M, d), statistics (M, 1), as norm_and_stats returns them).
    native: torch's native_layer_norm_backward (r unused). Else the closed form of
    docs/math.md on r = normalized(p, rstd, mean, spec): dq = (dr - mean(dr * r) r) * rstd
    with dr = do * scale * (w0 + w), less mean(dr) for a centred norm (mean(r) = 0)."""
    do = _as(do, acc_dtype(p.dtype))
    if native:
        b = None if bias is None else bias.to(p.dtype)
        dp, dw, db = torch.ops.aten.native_layer_norm_backward(
            do, p, [p.shape[-1]], mean, rstd, plain_weight(weight, spec, p), b, [True, need_w, need_b])
    else:
        dr = affine(do, spec, weight, None)
        dq = dr - r * (dr * r).mean(-1, keepdim=True)
        if spec.center:
            dq = dq - dr.mean(-1, keepdim=True)
        dp, dw, db = dq * rstd, (do * r).sum(0) if need_w else None, do.sum(0) if need_b else None
    if dw is not None and spec.scale != 1.0:  # the gradient of scale * (w0 + w) with respect to w
        dw = dw * spec.scale
    return dp, dw, db


def affine_(r: Tensor, spec: NormSpec, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """affine in place on r, for a caller done with r otherwise (norm_grads has read it):
    no fresh (M, d) buffer for the norm's rebuilt output."""
    w = plain_weight(weight, spec, r)  # scale * (w0 + w), or the scale alone
    if w is not None:
        r.mul_(w)
    return r if bias is None else r.add_(bias.to(r.dtype))


# ---------------------------------------------------------------- post-norm and sandwich
# norm_add: new_residual = a * residual + b * N_b(x); norm_add_norm adds out = N(new_residual).
# a: branch_spec.residual_scale or a [d] tensor; b: alpha or a [d] tensor. update="interpolate"
# (nGPT): new_residual = residual + b * (N_b(x) - residual), both norms unit_norm.
# The branch N_b(x) stays in the accumulation dtype until it is added: new_residual is
# rounded once, from the exact sum, as the kernels do (docs/math.md).
def unit_norm(p: Tensor, eps: float) -> Tensor:
    """nGPT's projection onto the unit sphere, p * rsqrt(p.p + eps) (eps on the sum of
    squares: spec.eps_on_sum), in transformers' DoryL2Norm's order of operations."""
    return p * torch.rsqrt(p.pow(2).sum(-1, keepdim=True) + eps)


def _norm_acc(p: Tensor, weight: Tensor | None, bias: Tensor | None, spec: NormSpec) -> Tensor:
    """N(p) in p's accumulation dtype: torch's own norm where it is a plain one (see _plain),
    nGPT's unit-sphere norm for spec.eps_on_sum (no weight or bias: the op refuses them)."""
    if spec.eps_on_sum:
        return unit_norm(_as(p, acc_dtype(p.dtype)), spec.eps)
    if plain_ok(p, spec):
        return _plain(p, weight, bias, spec)
    return norm_out(p.to(acc_dtype(p.dtype)), None, weight, bias, spec)[0]


def norm_add_fwd(x: Tensor, residual: Tensor, branch_weight: Tensor | None, branch_bias: Tensor | None,
                 weight: Tensor | None, bias: Tensor | None, branch_spec: NormSpec, spec: NormSpec, alpha: float,
                 residual_dtype: torch.dtype, second: bool, residual_scale: Tensor | None = None,
                 branch_scale: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(new_residual, out or None): new_residual = a * residual + b * N_b(x) in
    residual_dtype (a: residual_scale or branch_spec.residual_scale, b: branch_scale or
    alpha), or residual + b * (N_b(x) - residual) for branch_spec.interpolate, and with
    `second` out = N(new_residual) in x's dtype (spec.out_dtype's when set), N reading the
    stored new_residual. Plain differentiable torch ops."""
    y = _norm_acc(x, branch_weight, branch_bias, branch_spec)
    wide = torch.promote_types(torch.promote_types(y.dtype, residual.dtype), residual_dtype)
    if branch_spec.interpolate:  # r + b * (N_b(x) - r): DoryDecoderLayer's ops, in its order
        r = _as(residual, wide)
        b = alpha if branch_scale is None else _as(branch_scale, wide)
        new_residual = _as(r + b * (_as(y, wide) - r), residual_dtype)
    else:
        y = scaled(y, alpha if branch_scale is None else branch_scale, y.dtype)
        r = scaled(_as(residual, wide), branch_spec.residual_scale if residual_scale is None else residual_scale,
                   wide)
        new_residual = _as(r + _as(y, wide), residual_dtype)
    if not second:
        return new_residual, None
    return new_residual, _as(_norm_acc(new_residual, weight, bias, spec), spec.out_dtype_for(x.dtype))
