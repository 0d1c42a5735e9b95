"""`bench.py overhead`: host time per call with every kernel launch replaced by a
recorder: the Python, allocation and autograd work a GPU host also does around each
launch, which bounds small kernels (the backward at d = 1024 is ~100 us of GPU work on
an H100). Measured with tiny CPU tensors, so allocation here stands in for the GPU
caching allocator."""
from __future__ import annotations

import time

import torch

import fuseblock
from fuseblock.kernels import norm as kernels
from fuseblock.ops.checks import resolve
from fuseblock.ops.dispatch import kernels_on_cpu
from fuseblock.testing.sm90 import captured_launches


def best_us(fn, reps: int, calls: int) -> float:
    """The fastest of `reps` timings of `calls` calls, in us per call (after one untimed call)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def _kind_row(kind: str, reps: int, calls: int) -> dict:
    x = torch.randn(64, 1024, requires_grad=True)
    r, w = torch.randn_like(x, requires_grad=True), torch.randn(1024, requires_grad=True)
    b = torch.randn(1024, requires_grad=True) if kind == "layer" else None
    spec = resolve(x, r, w, b, None, kind=kind, c=None, eps=1e-6, gate_act="silu", gate_position="post",
                   num_groups=1, residual_dtype=None)
    xd, rd, wd = x.detach(), r.detach(), w.detach()
    bd = None if b is None else b.detach()
    stats = {}

    def launcher_fwd():
        _, _, stats["rstd"], stats["mean"] = kernels.norm_fwd(xd, rd, None, wd, bd, spec, xd.dtype, True)

    def launcher_bwd():
        kernels.norm_bwd(xd, xd, xd, None, wd, bd, stats["rstd"], stats["mean"], spec, xd.dtype, None)

    def eager_step():  # fuseblock.add_norm through autograd, as a training step calls it
        out, res = fuseblock.add_norm(x, r, w, b, kind=kind)
        torch.autograd.grad((out, res), [t for t in (x, r, w, b) if t is not None], (out, res))

    row = dict(kind=kind, d=1024)
    # The Triton path for CPU tensors, its kernels recorded rather than run.
    with kernels_on_cpu(), captured_launches(kernels):
        for name, fn in (("launcher_fwd_us", launcher_fwd), ("launcher_bwd_us", launcher_bwd),
                         ("eager_fwd_bwd_us", eager_step)):
            row[name] = best_us(fn, reps, calls)
    return row


def run(args) -> list[dict]:
    reps, calls = (3, 100) if args.quick else (7, 500)
    return [_kind_row(kind, reps, calls) for kind in ("rms", "layer")]
