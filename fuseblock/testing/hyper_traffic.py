"""The bytes one hyper-connection (mHC) boundary moves: the kernels against the unfused torch form.

Unfused is the torch ops DeepSeek-V4's decoder layer writes for a boundary (its update,
DeepseekV4HyperConnection and DeepseekV4RMSNorm: `fuseblock.reference.hyper` in the
deepseek_v4 form; hy_v4's without comb), each aten op one kernel reading its distinct
inputs and writing its outputs (EagerTraffic). Fused: `fuseblock.hc_add_norm`'s launches,
their distinct bytes counted by the Triton interpreter (KernelTraffic).

The compulsory minimum: forward reads H, f, post, comb and writes H', y, post', comb';
backward reads H (for dcomb), H' (for dfn and the projection's gradient), f, post, comb
and the outputs' gradients (dy, dH', dpost', dcomb'), and writes dH, df, dpost, dcomb. fn,
base, scale, weight, their gradients, the per-token mix and rho the forward keeps, da and
the partial rows are "other" bytes.
"""
from __future__ import annotations

import math

import torch

import fuseblock

from ..hyper_spec import Form, HyperSpec, Mode
from ..reference import hyper as hyper_reference
from .traffic import EagerTraffic, KernelTraffic

EPS = HC_EPS = 1e-6
# the kernels' arguments that hold per-token tensors (the launchers' names); SRC is H' in _bwd_params
ACTIVATION_ARGS = {"H", "F", "POST", "COMB", "HN", "Y", "POSTN", "COMBN", "DY", "DHN", "DPOSTN", "DCOMBN", "DH",
                   "DF", "DPOST", "DCOMB", "SRC"}


def boundary_inputs(rows: int, n: int, d: int, dtype, comb: bool = True) -> list[torch.Tensor | None]:
    """[streams, branch, post, comb, fn, base, scale, weight] of one boundary, every tensor
    requiring grad (comb None without comb); streams and branch in dtype, the rest fp32."""
    m = 2 * n + n * n if comb else 2 * n
    c = None
    if comb:
        c = torch.softmax(torch.randn(rows, n, n), -1)
        c = (c / c.sum(-2, keepdim=True)).requires_grad_()
    return [torch.randn(rows, n, d).to(dtype).requires_grad_(), torch.randn(rows, d).to(dtype).requires_grad_(),
            (2 * torch.rand(rows, n)).requires_grad_(), c,
            (torch.randn(m, n * d) / math.sqrt(n * d)).requires_grad_(), (0.5 * torch.randn(m)).requires_grad_(),
            torch.ones(3 if comb else 2).requires_grad_(), (1 + 0.1 * torch.randn(d)).requires_grad_()]


def boundary(inputs, fused: bool, iters: int = 20) -> list[torch.Tensor]:
    """(y, new_streams, post', comb') of one boundary, comb' left out without comb."""
    H, f, post, comb, fn, base, scale, w = inputs
    if fused:
        out = fuseblock.hc_add_norm(H, f, post, comb, fn, base, scale, w, iters=iters, hc_eps=HC_EPS, eps=EPS)
    else:
        n, d = H.shape[-2:]
        spec = HyperSpec(n=n, d=d, mode=Mode.PRE_POST_COMB if comb is not None else Mode.PRE_POST, update=True,
                         comb_in=comb is not None, iters=iters, hc_eps=HC_EPS, eps=EPS, post_mult=2.0,
                         post_eps=0.0, form=Form.DEEPSEEK_V4 if comb is not None else Form.HY_V4)
        out = hyper_reference.hyper_fwd(H, f, post, comb, fn, base, scale, w, spec)
    return [t for t in out if t is not None]


def minimum_bytes(inputs, outs) -> tuple[int, int]:
    """Compulsory (forward, backward) bytes, in the module docstring's model."""
    H, f, post, comb = inputs[:4]
    small_in = post.nbytes + (comb.nbytes if comb is not None else 0)
    y, hn, *coef = outs
    fwd = H.nbytes + f.nbytes + small_in + hn.nbytes + y.nbytes + sum(t.nbytes for t in coef)
    bwd_in = H.nbytes + hn.nbytes + f.nbytes + small_in + y.nbytes + hn.nbytes + sum(t.nbytes for t in coef)
    bwd_out = H.nbytes + f.nbytes + small_in
    return fwd, bwd_in + bwd_out


def kept_bytes(inputs, run) -> tuple[int, object]:
    """(bytes saved for backward beyond the inputs and new_streams, run's result): distinct storages."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = run()
    live = {t.untyped_storage().data_ptr() for t in [*inputs, outs[1]] if t is not None}
    return sum(b for p, b in saved.items() if p not in live), outs


def _activation_bytes(kt: KernelTraffic) -> int:
    parts = (part for ln in kt.launches for part in (ln.read, ln.written))
    return sum(v for part in parts for k, v in part.items() if k in ACTIVATION_ARGS)


def measure_hyper_traffic(rows: int, n: int, d: int, dtype, comb: bool = True, iters: int = 20) -> list[dict]:
    """Rows for fwd, bwd and fwd+bwd of one boundary: kernel, unfused and minimum bytes,
    launches and the unfused form's ops, bytes kept for backward."""
    torch.manual_seed(0)
    inputs = boundary_inputs(rows, n, d, dtype, comb)
    leaves = [t for t in inputs if t is not None]
    with KernelTraffic(glue=True) as kf:
        kept, outs = kept_bytes(inputs, lambda: boundary(inputs, True, iters))
    grads = [torch.randn_like(t) for t in outs]
    with KernelTraffic(glue=True) as kb:
        torch.autograd.grad(outs, leaves, grads)
    with EagerTraffic() as uf:
        ukept, uouts = kept_bytes(inputs, lambda: boundary(inputs, False, iters))
    with EagerTraffic() as ub:
        torch.autograd.grad(uouts, leaves, grads)
    min_f, min_b = minimum_bytes(inputs, outs)
    name = f"hc_add_norm n={n}" + ("" if comb else " no comb")
    parts = {"fwd": ([kf], [uf], min_f), "bwd": ([kb], [ub], min_b), "fwd+bwd": ([kf, kb], [uf, ub], min_f + min_b)}
    out = []
    for pas, (kts, uts, mn) in parts.items():
        kernel = sum(k.bytes + k.glue_bytes for k in kts)
        act = sum(map(_activation_bytes, kts))
        unfused = sum(u.bytes for u in uts)
        out.append(dict(
            op=name, dtype=str(dtype).removeprefix("torch."), rows=rows, d=d, pas=pas,
            kernel_MB=kernel / 1e6, unfused_MB=unfused / 1e6, min_MB=mn / 1e6, other_MB=(kernel - act) / 1e6,
            kernel_over_min=kernel / mn, act_over_min=act / mn, unfused_over_kernel=unfused / kernel,
            launches=sum(len(k.launches) + len(k.glue.ops) for k in kts), unfused_ops=sum(len(u.ops) for u in uts),
            kept_MB=kept / 1e6 if pas == "fwd" else None, unfused_kept_MB=ukept / 1e6 if pas == "fwd" else None,
        ))
    return out


# ---------------------------------------------------------------- one decoder layer, for bench.py stream
def layer_inputs(rows: int, d: int, dtype, n: int = 4):
    """(state, branches, weights) of an mHC layer: state (H, post, comb) as the last
    layer's MLP boundary left it; branches[j] the sublayer outputs; weights[j] (fn, base,
    scale, w) of boundary j. Every tensor requires grad."""
    b1 = boundary_inputs(rows, n, d, dtype)
    b2 = boundary_inputs(rows, n, d, dtype)
    return (b1[0], b1[2], b1[3]), [b1[1], b2[1]], [b1[4:], b2[4:]]


def layer(state, branches, weights, fused: bool, iters: int = 20) -> list[torch.Tensor]:
    """Each boundary's y (the next mixer's input), then the state handed on (H, post, comb)."""
    H, post, comb = state
    ys = []
    for branch, ws in zip(branches, weights, strict=True):
        y, H, post, comb = boundary([H, branch, post, comb, *ws], fused, iters)
        ys.append(y)
    return [*ys, H, post, comb]
