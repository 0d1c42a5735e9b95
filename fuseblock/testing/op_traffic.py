"""One op's bytes moved, forward and backward: Triton kernels, naive eager, and the minimum.

Byte model: the compulsory minimum reads each external activation input once and writes
each activation output once (forward: x, x1, residual, gate in; out, new_residual out.
Backward: the saved p, gate, grad_out, grad_new_residual in; dx, a separate dresidual
when its dtype differs or dx is not dp (alpha != 1, dropout), a dx1 apart from dx with
dropout (its own mask), dgate out). The dropout masks are no bytes: the kernels
regenerate them from a seed, drawn on the host and passed by value (read from the device,
as "other", only while a CUDA graph is captured). Weights, biases, row statistics, the per-program
dw/db partial rows (written by one launch, summed by the next or by the last program of
the same launch: kernel bytes either way) and dw/db themselves are reported apart, as
"other".

The kernel counts need the Triton interpreter (TRITON_INTERPRET=1 before triton is
imported); the naive counts do not.
"""
from __future__ import annotations

import torch

from ..spec import residual_grad_dtype
from .cases import fused, leaves, naive, op_inputs, residual_fused, residual_inputs, residual_naive
from .traffic import EagerTraffic, KernelTraffic

# Kernel argument names by role (the launchers' parameter names).
ACTIVATION_ARGS = {"X", "X1", "R", "Z", "O", "RO", "P", "DO", "DRO", "DX", "DX1", "DR", "DZ"}  # the launchers' names
# all but the weights, which stay cached: DWP, DBP are the dw/db partial rows, CNT the
# wide-row backward's arrival counters, SEED the dropout masks' key
UNCACHED_ARGS = ACTIVATION_ARGS | {"RSTD", "MEAN", "DOT", "DWP", "DBP", "DW", "DB", "CNT", "SEED", "?"}
# norm_add's kernels add the branch norm's statistics, partial rows and gradients
UNCACHED_ARGS |= {"RSTDB", "MEANB", "DBWP", "DBBP", "DBW", "DBB"}


def minimum_bytes(x, residual, kw, out, new_res) -> tuple[int, int]:
    """Compulsory (forward, backward) bytes: each activation in once, each out once."""
    gate = kw["gate"].nbytes if "gate" in kw else 0
    x1 = kw["x1"].nbytes if "x1" in kw else 0
    fwd_in = x.nbytes + x1 + (residual.nbytes if residual is not None else 0) + gate
    fwd_out = out.nbytes + (new_res.nbytes if new_res is not None else 0)
    p_bytes = new_res.nbytes if new_res is not None else x.nbytes
    bwd_in = p_bytes + out.nbytes + (new_res.nbytes if new_res is not None else 0) + gate
    dropout = kw.get("dropout_p", 0) > 0
    scaled = kw.get("alpha", 1.0) != 1.0 or dropout
    separate = residual is not None and (scaled or residual_grad_dtype(x.dtype, residual.dtype) is not None)
    bwd_out = x.nbytes + (residual.nbytes if separate else 0) + gate  # else dx is also dresidual
    bwd_out += x1 if dropout else 0  # else dx1 is dx
    return fwd_in + fwd_out, bwd_in + bwd_out


def activation_bytes(kt: KernelTraffic) -> int:
    parts = (part for ln in kt.launches for part in (ln.read, ln.written))
    return sum(v for part in parts for k, v in part.items() if k in ACTIVATION_ARGS)


def measure_traffic(op: str, rows: int, d: int, dtype) -> list[dict]:
    """Rows for fwd, bwd and fwd+bwd of one op: kernel, naive and minimum bytes."""
    torch.manual_seed(0)
    x, residual, w, kw = op_inputs(op, rows, d, dtype)
    grad_leaves = leaves(x, residual, w, kw)
    with KernelTraffic(glue=True) as kf:
        out, new_res = fused(op, x, residual, w, kw)
    outs = [out] + ([new_res] if new_res is not None else [])
    grads = [torch.randn_like(t) for t in outs]
    with KernelTraffic(glue=True) as kb:
        torch.autograd.grad(outs, grad_leaves, grads)
    with EagerTraffic() as nf:
        nouts = [t for t in naive(op, x, residual, w, kw) if t is not None]
    with EagerTraffic() as nb:
        torch.autograd.grad(nouts, grad_leaves, grads)
    with EagerTraffic() as n1f:
        nouts = [t for t in naive(op, x, residual, w, kw, one_kernel_norm=True) if t is not None]
    with EagerTraffic() as n1b:
        torch.autograd.grad(nouts, grad_leaves, grads)
    min_f, min_b = minimum_bytes(x, residual, kw, out, new_res)

    parts = {"fwd": ([kf], [nf], [n1f], min_f), "bwd": ([kb], [nb], [n1b], min_b),
             "fwd+bwd": ([kf, kb], [nf, nb], [n1f, n1b], min_f + min_b)}
    out_rows = []
    for pas, (kts, nts, n1s, mn) in parts.items():
        out_rows.append(_row(op, dtype, rows, d, pas, kts, nts, n1s, mn))
    return out_rows


def _row(op, dtype, rows, d, pas, kts, nts, n1s, mn) -> dict:
    """One row of measure_traffic or measure_residual_traffic: the kernels' counts kts, the
    naive eager ones nts (n1s: one kernel per torch norm) and the minimum mn, for one pass."""
    a = sum(map(activation_bytes, kts))
    kernel = sum(k.bytes + k.glue_bytes for k in kts)
    uncached = sum(k.accessed(UNCACHED_ARGS) + k.glue_bytes for k in kts)
    naive_b, naive1 = sum(n.bytes for n in nts), sum(n.bytes for n in n1s)
    return dict(
        op=op, dtype=str(dtype).removeprefix("torch."), rows=rows, d=d, pas=pas,
        kernel_MB=kernel / 1e6, naive_MB=naive_b / 1e6, min_MB=mn / 1e6, other_MB=(kernel - a) / 1e6,
        kernel_over_min=kernel / mn, act_over_min=a / mn, uncached_over_min=uncached / mn,
        naive_over_kernel=naive_b / kernel, naive1_over_kernel=naive1 / kernel,
        launches=sum(len(k.launches) for k in kts), glue_ops=sum(len(k.glue.ops) for k in kts),
        naive_ops=sum(len(n.ops) for n in nts),
    )


def residual_minimum_bytes(op: str, x) -> tuple[int, int]:
    """Compulsory (forward, backward) bytes of norm_add / norm_add_norm, every activation
    of x's size: forward reads x and residual and writes new_residual (and out); backward
    reads x (and the saved new_residual) and the gradient at each output, and writes dx
    and dresidual, except norm_add's, which is the gradient at new_residual passed through
    (r' = r + alpha * N(x)): nothing to write."""
    if op == "norm_add":
        return 3 * x.nbytes, 3 * x.nbytes
    return 4 * x.nbytes, 6 * x.nbytes


def measure_residual_traffic(op: str, rows: int, d: int, dtype) -> list[dict]:
    """measure_traffic's rows for an op of cases.RESIDUAL_OPS: fused against unfused."""
    torch.manual_seed(0)
    x, residual, bw, w = residual_inputs(rows, d, dtype)
    grad_leaves = [x, residual, bw] + ([w] if op == "norm_add_norm" else [])
    with KernelTraffic(glue=True) as kf:
        outs = [t for t in residual_fused(op, x, residual, bw, w) if t is not None]
    grads = [torch.randn_like(t) for t in outs]
    with KernelTraffic(glue=True) as kb:
        torch.autograd.grad(outs, grad_leaves, grads)
    counted = []
    for one_kernel in (False, True):
        with EagerTraffic() as nf:
            nouts = [t for t in residual_naive(op, x, residual, bw, w, one_kernel) if t is not None]
        with EagerTraffic() as nb:
            torch.autograd.grad(nouts, grad_leaves, grads)
        counted.append((nf, nb))
    (nf, nb), (n1f, n1b) = counted
    min_f, min_b = residual_minimum_bytes(op, x)
    parts = {"fwd": ([kf], [nf], [n1f], min_f), "bwd": ([kb], [nb], [n1b], min_b),
             "fwd+bwd": ([kf, kb], [nf, nb], [n1f, n1b], min_f + min_b)}
    return [_row(op, dtype, rows, d, pas, *counts) for pas, counts in parts.items()]
