"""`bench.py overhead`: host time per call.

- Kernel rows: every kernel launch replaced by a recorder: the Python, allocation and
  autograd work a GPU host also does around each launch, which bounds small kernels (the
  backward at d = 1024 is ~100 us of GPU work on an H100). Measured with tiny CPU
  tensors, so allocation here stands in for the GPU caching allocator.
  `serve_us`: `fuseblock.serve.fused_add_rms_norm` (or `fused_add_layer_norm`) on the
  same tensors, against `train_fwd_us`, the training op's forward (`fuseblock.add_norm`,
  its torch.ops custom op) under torch.inference_mode: what a serving engine pays per
  norm call either way.
- Torch-path rows: eager `add_norm` forward + backward at 1 x 1024 fp32 on the torch
  path against the naive form it replaces, `x + r` then `F.rms_norm` (or `F.layer_norm`)
  (form "function"), and `fuseblock.AddNorm` against `x + r` then `nn.RMSNorm` (or
  `nn.LayerNorm`) (form "module"), alternated call by call; the median and min-max of the
  per-run medians.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import fuseblock
from fuseblock import serve
from fuseblock.kernels import norm as kernels
from fuseblock.ops.checks import resolve
from fuseblock.ops.dispatch import kernels_on_cpu
from fuseblock.testing.targets import captured_launches


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

    xs, rs = xd.clone(), rd.clone()

    def serve_call():  # in place, as a serving engine calls it (the launch is recorded, not run)
        if kind == "rms":
            serve.fused_add_rms_norm(xs, rs, wd, 1e-6)
        else:
            serve.fused_add_layer_norm(xs, rs, wd, bd, 1e-6)

    def train_fwd():
        with torch.inference_mode():
            fuseblock.add_norm(xd, rd, wd, bd, kind=kind, eps=1e-6, residual_dtype=rd.dtype)

    row = dict(kind=kind, d=1024)
    # The Triton path for CPU tensors, its kernels recorded rather than run.
    with kernels_on_cpu(), captured_launches(kernels):
        for name, fn in (("launcher_fwd_us", launcher_fwd), ("launcher_bwd_us", launcher_bwd),
                         ("eager_fwd_bwd_us", eager_step), ("serve_us", serve_call), ("train_fwd_us", train_fwd)):
            row[name] = best_us(fn, reps, calls)
    return row


def _torch_path_row(kind: str, form: str, repeats: int, calls: int) -> dict:
    x, r = torch.randn(1, 1024, requires_grad=True), torch.randn(1, 1024, requires_grad=True)
    if form == "module":  # fuseblock.AddNorm against x + r then nn.RMSNorm / nn.LayerNorm
        fused_norm = fuseblock.AddNorm(1024, kind=kind, eps=1e-6)
        naive_norm = torch.nn.LayerNorm(1024, eps=1e-6) if kind == "layer" else torch.nn.RMSNorm(1024, eps=1e-6)
        naive_norm.load_state_dict(fused_norm.state_dict())
        leaves = [x, r, *fused_norm.parameters()]
        naive_leaves = [x, r, *naive_norm.parameters()]

        def fused():
            out, res = fused_norm(x, r)
            torch.autograd.grad((out, res), leaves, (out, res))

        def naive():
            res = x + r
            out = naive_norm(res)
            torch.autograd.grad((out, res), naive_leaves, (out, res))
    else:  # fuseblock.add_norm against x + r then F.rms_norm / F.layer_norm
        w = torch.randn(1024, requires_grad=True)
        b = torch.randn(1024, requires_grad=True) if kind == "layer" else None
        leaves = [t for t in (x, r, w, b) if t is not None]

        def fused():
            out, res = fuseblock.add_norm(x, r, w, b, kind=kind)
            torch.autograd.grad((out, res), leaves, (out, res))

        def naive():
            res = x + r
            out = F.layer_norm(res, (1024,), w, b, 1e-6) if kind == "layer" else F.rms_norm(res, (1024,), w, 1e-6)
            torch.autograd.grad((out, res), leaves, (out, res))

    runs = {"fused": [], "naive": []}
    for fn in (fused, naive):
        fn()
    for i in range(repeats):
        order = (("fused", fused), ("naive", naive)) if i % 2 else (("naive", naive), ("fused", fused))
        times = {"fused": [], "naive": []}
        for _ in range(calls):
            for name, fn in order:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        for name, v in times.items():
            runs[name].append(statistics.median(v) * 1e6)
    ratio = [f / n for f, n in zip(runs["fused"], runs["naive"], strict=True)]
    return dict(kind=kind, d=1024, path="torch", form=form, fused_us=statistics.median(runs["fused"]),
                fused_min_us=min(runs["fused"]), fused_max_us=max(runs["fused"]),
                naive_us=statistics.median(runs["naive"]), naive_min_us=min(runs["naive"]),
                naive_max_us=max(runs["naive"]), fused_over_naive=statistics.median(ratio),
                ratio_min=min(ratio), ratio_max=max(ratio))


def run(args) -> list[dict]:
    reps, calls = (3, 100) if args.quick else (7, 500)
    rows = [_kind_row(kind, reps, calls) for kind in ("rms", "layer")]
    return rows + [_torch_path_row(kind, form, args.repeats, calls) for form in ("function", "module")
                   for kind in ("rms", "layer")]
