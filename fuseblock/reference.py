"""Pure-PyTorch forward and backward of the normalize op family: the CPU path.

Same contract as the Triton launchers in `fuseblock.kernels.norm` (2-D (M, d) inputs,
fp32 statistics, the same saved tensors), written with plain torch ops so it runs
anywhere and documents the math. Symbols follow docs/math.md:

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

from .spec import Act, Gate, NormSpec, acc_dtype


def gate_act(z: Tensor, act: Act) -> Tensor:
    """g(z)."""
    if act == Act.IDENTITY:
        return z
    if act == Act.SIGMOID:
        return torch.sigmoid(z)
    if act == Act.SILU:
        return torch.nn.functional.silu(z)
    raise ValueError(f"unknown gate activation {act!r}")


def gate_act_grad(z: Tensor, act: Act) -> Tensor:
    """g'(z)."""
    if act == Act.IDENTITY:
        return torch.ones_like(z)
    s = torch.sigmoid(z)
    if act == Act.SIGMOID:
        return s * (1 - s)
    if act == Act.SILU:
        return s * (1 + z * (1 - s))
    raise ValueError(f"unknown gate activation {act!r}")


def _grouped(t: Tensor, groups: int) -> Tensor:
    return t.reshape(-1, groups, t.shape[-1] // groups)  # (M, G, d/G) for any leading shape


def _normalized(s: Tensor, spec: NormSpec, rstd: Tensor, mean: Tensor | None) -> Tensor:
    """r = (s - mean) * rstd per group, back in (M, d)."""
    sg = _grouped(s, spec.groups)
    q = sg - mean[..., None] if spec.center else sg
    return (q * rstd[..., None]).reshape(s.shape)


def _weight(weight: Tensor | None, spec: NormSpec, dtype: torch.dtype) -> Tensor | None:
    """weight_offset + weight in the accumulation dtype (the sum is never rounded to the weight's)."""
    if weight is None:
        return None
    w = weight.to(dtype)
    return w + spec.weight_offset if spec.weight_offset != 0.0 else w


def _affine(r: Tensor, spec: NormSpec, weight, bias) -> Tensor:
    o1 = r * spec.scale
    if weight is not None:
        o1 = o1 * _weight(weight, spec, r.dtype)
    if bias is not None:
        o1 = o1 + bias.to(r.dtype)
    return o1


# ---------------------------------------------------------------- native fast path
# In fp32 with no gate and one group, ATen's fused CPU kernels compute the same math in
# one pass each way (3-4x faster than the composition below). They take the scale
# c/sqrt(d) folded into the weight.
def _has_fused_rms() -> bool:
    """Whether ATen has `_fused_rms_norm(input, normalized_shape, weight, eps)` (torch 2.9+).
    Older torch lacks it or takes other arguments: RMS then takes the composed path."""
    try:
        args = torch.ops.aten._fused_rms_norm.default._schema.arguments
    except (AttributeError, RuntimeError):
        return False
    return [a.name for a in args[:2]] == ["input", "normalized_shape"]


_FUSED_RMS = _has_fused_rms()


def _native_ok(p: Tensor, spec: NormSpec) -> bool:
    return p.dtype == torch.float32 and spec.gate == Gate.NONE and spec.groups == 1 and (spec.center or _FUSED_RMS)


def _scaled_weight(weight: Tensor | None, spec: NormSpec, d: int, like: Tensor) -> Tensor | None:
    w = _weight(weight, spec, like.dtype)
    if spec.scale == 1.0:
        return w
    s = torch.full((d,), spec.scale, dtype=like.dtype, device=like.device)
    return s if w is None else s * w


def _native_fwd(p: Tensor, weight, bias, spec: NormSpec):
    d = p.shape[-1]
    w = _scaled_weight(weight, spec, d, p)
    b = None if bias is None else bias.to(p.dtype)
    if spec.center:
        out, mean, rstd = torch.native_layer_norm(p, [d], w, b, spec.eps)
        return out, rstd.reshape(-1, 1), mean.reshape(-1, 1)
    out, rstd = torch.ops.aten._fused_rms_norm(p, [d], w, spec.eps)
    return (out if b is None else out + b), rstd.reshape(-1, 1), None


def _native_bwd(dout: Tensor, p: Tensor, weight, bias, rstd: Tensor, mean, spec: NormSpec):
    d = p.shape[-1]
    w = _scaled_weight(weight, spec, d, p)
    need_w = weight is not None
    if spec.center:
        shape = p.shape[:-1] + (1,)
        dp, dws, _ = torch.ops.aten.native_layer_norm_backward(
            dout, p, [d], mean.reshape(shape), rstd.reshape(shape), w, None, [True, need_w, False]
        )
    else:  # ATen has no CPU kernel for the fused RMS backward: dq = (dr - mean(r*dr) r) rstd
        rs = rstd.reshape(p.shape[:-1] + (1,))
        dr = dout if w is None else dout * w
        c1 = (dr * p).mean(-1, keepdim=True) * rs * rs  # mean(r * dr) / rstd; not rs^2, which overflows at eps = 0
        dp = torch.addcmul(dr, p, c1, value=-1).mul_(rs)  # in place: fewer passes
        dws = (dout * p).reshape(-1, d).t() @ rs.reshape(-1) if need_w else None
    rows = (-1, d)
    # dws is the gradient of the scaled weight w' = scale * w, against r = q * rstd
    dw = None if not need_w else dws * spec.scale
    db = None if bias is None else dout.reshape(rows).sum(0)
    return dp, dw, db


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
        shift = sg[..., :1]
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
    o = _affine((q * rstd[..., None]).reshape(s.shape), spec, weight, bias)
    if spec.gate == Gate.POST:
        o = o * g
    return o, rstd, mean


def norm_fwd(
    x: Tensor,
    residual: Tensor | None,
    gate: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    spec: NormSpec,
    residual_dtype: torch.dtype | None,
    need_stats: bool,
    native: bool = True,
):
    """Returns (out, new_residual or None, rstd (M, G) or None, mean (M, G) or None).

    new_residual is written only when residual_dtype is given (the caller passes it
    whenever there is a residual or a dtype change). The norm then reads the stored,
    rounded value, so the fused stream sees exactly what the naive one would.
    native=False keeps to plain differentiable ops (no ATen fused norm kernels), for
    torch.func transforms.
    """
    acc = acc_dtype(x.dtype)
    p = x.to(acc) if residual is None else x.to(acc) + residual.to(acc)
    new_residual = None
    if residual_dtype is not None:
        new_residual = p.to(residual_dtype)
        p = new_residual.to(acc)
    # eps = 0 takes the composition: its statistics are scale-safe, ATen's are not
    if native and spec.eps > 0 and _native_ok(p, spec):
        out, rstd, mean = _native_fwd(p, weight, bias, spec)
    else:
        out, rstd, mean = norm_out(p, gate, weight, bias, spec)
    if not need_stats:
        rstd = mean = None
    return out.to(x.dtype), new_residual, rstd, mean


def _as(grad: Tensor | None, param: Tensor | None) -> Tensor | None:
    """A parameter's gradient in the parameter's dtype."""
    return None if grad is None else grad.to(param.dtype)


def norm_bwd(
    dout: Tensor,
    dres: Tensor | None,
    p: Tensor,
    gate: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    rstd: Tensor,
    mean: Tensor | None,
    spec: NormSpec,
    x_dtype: torch.dtype,
    residual_grad_dtype: torch.dtype | None,
):
    """Returns (dx, dresidual or None, dgate, dw, db), like the Triton backward: dw and db
    in the weight's and the bias's dtypes.

    dx already includes dres (docs/math.md: the residual's gradient adds into dx) and is also the residual's
    gradient; a separate dresidual comes back only for a residual_grad_dtype.
    """
    acc = rstd.dtype
    p = p.to(acc)
    dout = dout.to(acc)
    if spec.eps > 0 and _native_ok(p, spec):  # ATen's layer-norm backward overflows at rstd ~ 1/|x| ~ 1e30
        ds, dw, db = _native_bwd(dout, p, weight, bias, rstd, mean, spec)
        if dres is not None:
            ds = ds + dres.to(acc)
        dresidual = None if residual_grad_dtype is None else ds.to(residual_grad_dtype)
        return ds.to(x_dtype), dresidual, None, _as(dw, weight), _as(db, bias)
    z = gate.to(acc) if spec.gate != Gate.NONE else None
    g = gate_act(z, spec.act) if z is not None else None
    s = p * g if spec.gate == Gate.PRE else p
    r = _normalized(s, spec, rstd, mean)
    dgate = None
    if spec.gate == Gate.POST:
        dgate = dout * _affine(r, spec, weight, bias) * gate_act_grad(z, spec.act)
        do1 = dout * g
    else:
        do1 = dout
    rows = (-1, p.shape[-1])
    dw = (do1 * r * spec.scale).reshape(rows).sum(0) if weight is not None else None
    db = do1.reshape(rows).sum(0) if bias is not None else None
    dr = do1 * spec.scale
    if weight is not None:
        dr = dr * _weight(weight, spec, acc)
    rg, drg = _grouped(r, spec.groups), _grouped(dr, spec.groups)
    # docs/math.md: dq = (dr - (r.dr) r / d) / sigma
    dq = (drg - rg * (rg * drg).mean(-1, keepdim=True)) * rstd[..., None]
    if spec.center:  # dp = dq - mean(dq)
        dq = dq - dq.mean(-1, keepdim=True)
    ds = dq.reshape(p.shape)
    if spec.gate == Gate.PRE:
        dgate = ds * p * gate_act_grad(z, spec.act)
        ds = ds * g
    if dres is not None:
        ds = ds + dres.to(acc)
    dresidual = None if residual_grad_dtype is None else ds.to(residual_grad_dtype)
    dgate = None if dgate is None else dgate.to(gate.dtype)
    return ds.to(x_dtype), dresidual, dgate, _as(dw, weight), _as(db, bias)
