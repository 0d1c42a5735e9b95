"""An independent float64 reference, written straight from the formulas of docs/math.md.

It uses plain autograd for gradients, so it shares nothing with fuseblock's own
forward/backward code:
p = y + alpha * (x + x1); s = p * g(gate) (pre) or p; q = s or s - mean(s); sigma = sqrt(q.q/d + eps);
o1 = (c/sqrt(d)) * (q/sigma) * w + b; o = o1 * g(gate) (post) or o1.
"""
import math

import torch

ACTS = {
    "none": lambda y: y,
    "sigmoid": torch.sigmoid,
    "silu": lambda y: y * torch.sigmoid(y),
    "swish": lambda y: y * torch.sigmoid(y),
}


def add_norm64(x, residual=None, weight=None, bias=None, *, kind="rms", c=None, eps=None,
               gate=None, gate_act="silu", gate_position="post", num_groups=1, residual_dtype=None, alpha=1.0,
               x1=None):
    """Returns (out, p) in float64; differentiable w.r.t. every float64 leaf passed in.

    p = residual + alpha * (x + x1) (add_norm's branch; dropout: pass x and x1 times their
    masks over 1 - dropout_p).

    residual_dtype rounds p to the stored residual's precision (our adopted reading:
    the norm reads the stored new_residual); the rounding passes gradients straight through.
    eps=None is torch's default: F.layer_norm's 1e-5 for kind="layer", else F.rms_norm's,
    the machine epsilon of the stored p's computation dtype (fp64's for fp64, else fp32's).
    """
    if eps is None:
        stored = residual_dtype or (x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype))
        eps = 1e-5 if kind == "layer" else torch.finfo(torch.float64 if stored == torch.float64 else torch.float32).eps
    p = x.double() if x1 is None else x.double() + x1.double()
    if alpha != 1.0:
        p = alpha * p
    if residual is not None:
        p = p + residual.double()
    if residual_dtype is not None:
        p = p + (p.to(residual_dtype).double() - p).detach()
    g = ACTS[gate_act](gate.double()) if gate is not None else None
    s = p * g if g is not None and gate_position == "pre" else p
    d = s.shape[-1] // num_groups
    sg = s.unflatten(-1, (num_groups, d))
    q = sg - sg.mean(-1, keepdim=True) if kind == "layer" else sg
    if c is None:
        c = 1.0 if kind == "l2" else math.sqrt(d)
    sigma = torch.sqrt((q * q).sum(-1, keepdim=True) / d + eps)
    o = ((c / math.sqrt(d)) * q / sigma).flatten(-2)
    if weight is not None:
        o = o * weight.double()
    if bias is not None:
        o = o + bias.double()
    if g is not None and gate_position == "post":
        o = o * g
    return o, p


def leaf64(t):
    """A float64 leaf copy of t that requires grad (None stays None)."""
    return None if t is None else t.detach().double().requires_grad_(True)


def tolerances(dtype):
    """(atol, rtol) for comparing a result computed in `dtype` with fp32 statistics to fp64.

    fp32: accumulation error only. fp16/bf16: one rounding of the stored output
    (2^-11 and 2^-8 relative) plus the rounding of the inputs the reference also sees.
    """
    return {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 2e-2),
            torch.float64: (1e-10, 1e-10)}[dtype]
