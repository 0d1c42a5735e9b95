"""The ops the benchmarks and the traffic tests measure, each with its eager equivalent.

`OPS` names them; `op_inputs` builds one op's inputs, `fused` runs it through fuseblock
and `naive` runs the same function as eager torch (x + residual, then torch's own norm
and gate): the unfused composition fuseblock replaces.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import fuseblock

from ..reference import norm as reference
from ..spec import NormSpec
from .traffic import charge, uncounted

OPS = ["norm", "add_norm", "add_norm_layer", "add_norm_fp32_residual", "pre_gate", "post_gate", "post_gate_residual",
       "add_norm_scaled", "add_norm_parallel", "add_norm_dropout"]
# add_norm's branch, new_residual = residual + alpha * (drop(x) + drop(x1)), one keyword each
BRANCH = {"add_norm_scaled": dict(alpha=0.5), "add_norm_dropout": dict(dropout_p=0.1)}


def op_inputs(op: str, rows: int, d: int, dtype):
    """(x, residual, weight, keywords) for one op of OPS; every tensor requires grad."""
    x = torch.randn(rows, d).to(dtype).requires_grad_()
    residual = torch.randn(rows, d).to(dtype).requires_grad_() if "add_norm" in op or op.endswith("residual") else None
    gate = torch.randn(rows, d).to(dtype).requires_grad_() if "gate" in op else None
    w = (1 + 0.1 * torch.randn(d)).to(dtype).requires_grad_()
    kw = {}
    if gate is not None:
        kw = dict(gate=gate, gate_position="pre" if op.startswith("pre") else "post")
    if op == "add_norm_fp32_residual":
        residual = residual.detach().float().requires_grad_()
        kw["residual_dtype"] = torch.float32
    if op == "add_norm_layer":
        kw.update(kind="layer", bias=(0.1 * torch.randn(d)).to(dtype).requires_grad_())
    kw.update(BRANCH.get(op, {}))
    if op == "add_norm_parallel":
        kw["x1"] = torch.randn(rows, d).to(dtype).requires_grad_()
    return x, residual, w, kw


def leaves(x, residual, w, kw) -> list[torch.Tensor]:
    """The tensors of `op_inputs` that gradients flow to."""
    return [t for t in (x, residual, w, kw.get("bias"), kw.get("gate"), kw.get("x1")) if t is not None]


def fused(op, x, residual, w, kw):
    """(out, new_residual or None) from fuseblock."""
    if residual is None and "residual_dtype" not in kw:
        return fuseblock.norm(x, w, **kw), None
    return fuseblock.add_norm(x, residual, w, **kw)


class OneKernelRMSNorm(torch.autograd.Function):
    """torch's rms_norm charged as one kernel each way, as CUDA runs it: forward reads x, w
    and writes out, rstd; backward reads grad_out, x, rstd, w and writes dx, dw."""

    @staticmethod
    def forward(ctx, x, w):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        with uncounted():
            rstd = torch.rsqrt(x.to(acc).square().mean(-1, keepdim=True) + 1e-6)  # (M, 1)
            out = (x.to(acc) * rstd * w.to(acc)).to(x.dtype)
        charge("rms_norm (one kernel)", [x, w], [out, rstd])
        ctx.save_for_backward(x, w, rstd)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w, rstd = ctx.saved_tensors
        spec = NormSpec.of(x.shape[-1], kind="rms", c=None, eps=1e-6, num_groups=1, gate_act=None, gate_position=None)
        with uncounted():
            r = reference.normalized(x, rstd, None, spec)
            dx, dw, _ = reference.norm_grads(dout, x, r, rstd, None, w, None, spec, False, True, False)
            dx, dw = dx.to(x.dtype), dw.to(w.dtype)
        charge("rms_norm_backward (one kernel)", [dout, x, rstd, w], [dx, dw])
        return dx, dw


def naive(op, x, residual, w, kw, one_kernel_norm: bool = False):
    """The same function as eager torch: x + residual, then torch's own norm (and gate).
    one_kernel_norm: charge rms_norm as one kernel (CUDA) instead of the CPU's composite.
    The branch as its torch ops: x * alpha, x + x1, F.dropout(x), before the add."""
    if "dropout_p" in kw:
        x = F.dropout(x, kw["dropout_p"])
    if "x1" in kw:
        x = x + kw["x1"]
    if "alpha" in kw:
        x = x * kw["alpha"]
    p = x if residual is None else (x.to(residual.dtype) + residual if "residual_dtype" in kw else x + residual)
    g = F.silu(kw["gate"]) if "gate" in kw else None
    s = p * g if kw.get("gate_position") == "pre" else p
    if kw.get("kind") == "layer":
        out = F.layer_norm(s, (s.shape[-1],), w.to(s.dtype), kw["bias"].to(s.dtype), 1e-6)
    elif one_kernel_norm:
        out = OneKernelRMSNorm.apply(s, w.to(s.dtype))
    else:
        out = F.rms_norm(s, (s.shape[-1],), w.to(s.dtype), 1e-6)
    out = out.to(x.dtype)
    if kw.get("gate_position") == "post":
        out = out * g
    return out, (p if residual is not None else None)


# The post-norm and sandwich residual updates (fuseblock.norm_add, norm_add_norm), RMS
# norms with weights, alpha 0.5: their unfused form is the branch norm, the scaled add
# and (sandwich) the second norm.
RESIDUAL_OPS = ["norm_add", "norm_add_norm"]


def residual_inputs(rows: int, d: int, dtype):
    """(x, residual, branch_weight, weight) for RESIDUAL_OPS; every tensor requires grad."""
    x, residual = (torch.randn(rows, d).to(dtype).requires_grad_() for _ in range(2))
    bw, w = ((1 + 0.1 * torch.randn(d)).to(dtype).requires_grad_() for _ in range(2))
    return x, residual, bw, w


def residual_fused(op, x, residual, bw, w):
    """(out or None, new_residual) from fuseblock."""
    if op == "norm_add":
        return None, fuseblock.norm_add(x, residual, bw, alpha=0.5)
    return fuseblock.norm_add_norm(x, residual, bw, w, alpha=0.5)


def residual_naive(op, x, residual, bw, w, one_kernel_norm: bool = False):
    """The same as eager torch: rms_norm(x), the scaled add, and (norm_add_norm) rms_norm
    of the sum. one_kernel_norm: each rms_norm charged as one kernel, as CUDA runs it."""
    def rms(t, weight):
        if one_kernel_norm:
            return OneKernelRMSNorm.apply(t, weight)
        return F.rms_norm(t, (t.shape[-1],), weight, 1e-6)

    new_res = residual + 0.5 * rms(x, bw)
    return (rms(new_res, w) if op == "norm_add_norm" else None), new_res
