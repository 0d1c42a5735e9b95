"""The hidden-stream bytes of one decoder layer, for each stream shape: untouched against fused.

A layer's residual adds and norms, its mixers cut out: each mixer's output is an input of
the layer (a branch), and each norm output a mixer reads is an output, with the stream.
One join per sublayer takes a branch and the stream and gives the next mixer's input and
the new stream; a layer is two joins (attention's, then the MLP's), one for a parallel
layer (both mixers read one norm). Per layer, in the steady state of a deep stack, each
join's norm is the next mixer's input norm:

    shape       untouched (the torch ops a model writes)         fused (fuseblock)
    pre-norm    s' = s + b;  n = N(s')                            add_norm(b, s)
    scaled      s' = s + b * a;  n = N(s')                        add_norm(b, s, alpha=a)
    parallel    s' = b_mlp + b_attn + s;  n = N(s')  (one join)   add_norm(b_attn, s, x1=b_mlp)
    dropout     s' = s + drop(b);  n = N(s')                      add_norm(b, s, dropout_p=p)
    post-norm   s' = s + N_b(b)  (s' is the next mixer's input)   norm_add(b, s)
    sandwich    s' = s + N_b(b);  n = N(s')                       norm_add_norm(b, s)
    mhc         n = 4 streams H (docs/stream.md): H' = post b + comb^T H,    hc_add_norm(H, b, post, comb, ...)
                then post', comb', n = N(sum pre_i H'_i)  (DeepSeek-V4's ops; fuseblock.testing.hyper_traffic)

Untouched, every op is counted as a GPU runs it, one kernel each reading its inputs and
writing its outputs (EagerTraffic): the add and the mul one aten op each, torch's
rms_norm one kernel each way (cases.OneKernelRMSNorm: out and the row statistics forward,
dx and dw backward), dropout one kernel writing its output and a one-byte mask that
backward reads (as CUDA's native_dropout). Fused, the Triton kernels' distinct bytes under
the interpreter (KernelTraffic) plus any torch op between them (the dropout seed). Both
forms compute the same function (`layer`; tests/tools/test_bench.py checks it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import fuseblock

from . import hyper_traffic
from .cases import OneKernelRMSNorm
from .traffic import EagerTraffic, KernelTraffic, charge, uncounted

STREAM_SHAPES = ["pre-norm", "scaled", "parallel", "dropout", "post-norm", "sandwich", "mhc"]
ALPHA = 0.5  # the scaled shape's branch scale (Granite's residual_multiplier is 0.22)
DROPOUT_P = 0.1
EPS = 1e-6  # OneKernelRMSNorm's


class OneKernelDropout(torch.autograd.Function):
    """F.dropout charged as CUDA's native_dropout runs it: forward reads x and writes the
    output and a bool mask; backward reads the gradient and the mask and writes dx."""

    @staticmethod
    def forward(ctx, x, p):
        with uncounted():
            mask = torch.rand(x.shape, device=x.device) >= p
            out = x * mask / (1 - p)
        charge("native_dropout (one kernel)", [x], [out, mask])
        ctx.save_for_backward(mask)
        ctx.scale = 1 / (1 - p)
        return out

    @staticmethod
    def backward(ctx, dout):
        (mask,) = ctx.saved_tensors
        with uncounted():
            dx = dout * mask * ctx.scale
        charge("native_dropout_backward (one kernel)", [dout, mask], [dx])
        return dx, None


def layer_inputs(shape: str, rows: int, d: int, dtype) -> tuple[torch.Tensor, list, list[list]]:
    """(stream, branches, weights) of one layer of `shape`: branches[j] the branch (a pair
    for parallel) and weights[j] the norm weights (N_b first where there is one) of join j.
    Every tensor requires grad. mhc: the stream is (H, post, comb) (hyper_traffic.layer_inputs)."""
    if shape == "mhc":
        return hyper_traffic.layer_inputs(rows, d, dtype)

    def act():
        return torch.randn(rows, d).to(dtype).requires_grad_()

    def weight():
        return (1 + 0.1 * torch.randn(d)).to(dtype).requires_grad_()

    stream = act()
    if shape == "parallel":
        return stream, [(act(), act())], [[weight()]]
    n_weights = 2 if shape == "sandwich" else 1
    return stream, [act(), act()], [[weight() for _ in range(n_weights)] for _ in range(2)]


def _rms(t, w, one_kernel):
    return OneKernelRMSNorm.apply(t, w) if one_kernel else F.rms_norm(t, (t.shape[-1],), w, EPS)


def _untouched_join(shape, branch, stream, ws, one_kernel):
    if shape == "post-norm":
        return (stream + _rms(branch, ws[0], one_kernel),)
    if shape == "sandwich":
        s = stream + _rms(branch, ws[0], one_kernel)
        return _rms(s, ws[1], one_kernel), s
    if shape == "parallel":  # GPT-NeoX's order: mlp_output + attn_output + residual
        s = branch[1] + branch[0] + stream
    elif shape == "dropout":
        s = stream + (OneKernelDropout.apply(branch, DROPOUT_P) if one_kernel else F.dropout(branch, DROPOUT_P))
    elif shape == "scaled":  # Granite's residual + hidden_states * residual_multiplier
        s = stream + branch * ALPHA
    else:
        s = stream + branch
    return _rms(s, ws[0], one_kernel), s


def _fused_join(shape, branch, stream, ws):
    if shape == "post-norm":
        return (fuseblock.norm_add(branch, stream, ws[0], eps=EPS),)
    if shape == "sandwich":
        return fuseblock.norm_add_norm(branch, stream, ws[0], ws[1], eps=EPS, branch_eps=EPS)
    kw = {"scaled": dict(alpha=ALPHA), "dropout": dict(dropout_p=DROPOUT_P)}.get(shape, {})
    if shape == "parallel":
        return fuseblock.add_norm(branch[0], stream, ws[0], eps=EPS, x1=branch[1])
    return fuseblock.add_norm(branch, stream, ws[0], eps=EPS, **kw)


def layer(shape: str, stream, branches, weights, fused: bool, one_kernel: bool = True) -> list[torch.Tensor]:
    """One layer's outputs: each join's norm output (what the next mixer reads; post-norm:
    the new stream itself), then the stream the layer hands on."""
    if shape == "mhc":
        return hyper_traffic.layer(stream, branches, weights, fused)
    outs = []
    for branch, ws in zip(branches, weights, strict=True):
        got = _fused_join(shape, branch, stream, ws) if fused else _untouched_join(shape, branch, stream, ws,
                                                                                     one_kernel)
        stream = got[-1]
        outs += got[:-1] if len(got) > 1 else [stream]
    return outs if shape == "post-norm" else outs + [stream]


def _leaves(stream, branches, weights) -> list[torch.Tensor]:
    flat = [t for b in branches for t in (b if isinstance(b, tuple) else (b,))]
    streams = list(stream) if isinstance(stream, tuple) else [stream]  # mhc: (H, post, comb)
    return [*streams, *flat, *(w for ws in weights for w in ws)]


def measure_stream_traffic(shape: str, rows: int, d: int, dtype) -> list[dict]:
    """Rows for fwd, bwd and fwd+bwd of one layer of `shape`: the bytes moved untouched and
    fused, their ratio, and each in units of one hidden state (rows x d in dtype)."""
    torch.manual_seed(0)
    stream, branches, weights = layer_inputs(shape, rows, d, dtype)
    leaves = _leaves(stream, branches, weights)
    with KernelTraffic(glue=True) as kf:
        outs = layer(shape, stream, branches, weights, fused=True)
    grads = [torch.randn_like(t) for t in outs]
    with KernelTraffic(glue=True) as kb:
        torch.autograd.grad(outs, leaves, grads)
    with EagerTraffic() as uf:
        uouts = layer(shape, stream, branches, weights, fused=False)
    with EagerTraffic() as ub:
        torch.autograd.grad(uouts, leaves, grads)
    hidden = rows * d * torch.empty((), dtype=dtype).element_size()
    parts = {"fwd": ([kf], [uf]), "bwd": ([kb], [ub]), "fwd+bwd": ([kf, kb], [uf, ub])}
    out = []
    for pas, (kts, uts) in parts.items():
        fused_b = sum(k.bytes + k.glue_bytes for k in kts)
        untouched_b = sum(u.bytes for u in uts)
        out.append(dict(
            shape=shape, dtype=str(dtype).removeprefix("torch."), rows=rows, d=d, pas=pas,
            untouched_MB=untouched_b / 1e6, fused_MB=fused_b / 1e6, untouched_over_fused=untouched_b / fused_b,
            untouched_hiddens=untouched_b / hidden, fused_hiddens=fused_b / hidden,
            untouched_ops=sum(len(u.ops) for u in uts),
            fused_launches=sum(len(k.launches) for k in kts) + sum(len(k.glue.ops) for k in kts),
        ))
    return out
