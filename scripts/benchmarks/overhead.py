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
- Op rows (`path="ops"`): each public op (`add_norm` rms and layer, `norm`, `norm_add`) on
  the kernel path, per call: `fwd_us` a forward under torch.no_grad, `fwd_bwd_us` a
  forward with grad and `torch.autograd.grad` through it; `fwd_calls`, `fwd_bwd_calls` the
  Python and builtin function calls per call (sys.setprofile: independent of the
  machine's speed and load); `eager_*` the same of the naive eager form (`x + r` then
  torch's norm). --device cuda: the real launches, timed as wall time per call over a
  batch of calls (synchronized at its end: small inputs are host-bound, so this is the
  host's time); --device cpu (or no GPU): CPU tensors whose launches are recorded, not
  run: fuseblock's own Python and allocations, without Triton's launch, timed as this
  thread's CPU time (time.thread_time: steady on a machine shared with other work). The
  median of the repeats' per-call means.
"""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import fuseblock
from fuseblock import serve
from fuseblock.kernels import norm as kernels
from fuseblock.ops.checks import resolve
from fuseblock.ops.dispatch import kernels_on_cpu
from fuseblock.testing import targets
from fuseblock.testing.targets import captured_launches

RECORDER_FILE = targets.__file__  # the launch recorder's frames (calls_per_call)


def per_call_us(fn: Callable[[], object], reps: int, calls: int, sync: Callable[[], object] = lambda: None,
                clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """`reps` timings by `clock` of `calls` calls each, in us per call, after a few untimed
    calls; sync() ends each batch (a GPU's queue drained)."""
    for _ in range(3):
        fn()
    sync()
    per_call = []
    for _ in range(reps):
        t0 = clock()
        for _ in range(calls):
            fn()
        sync()
        per_call.append((clock() - t0) / calls * 1e6)
    return per_call


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
            row[name] = min(per_call_us(fn, reps, calls))  # the fastest run
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


def calls_per_call(fn: Callable[[], object], calls: int = 20) -> float:
    """Function calls (Python and builtin) per call of fn, after two uncounted calls (the first
    imports the kernels, triton with them, whose ABC registrations make the second re-check
    torch's `isinstance(outputs, Sequence)` in autograd.grad: 39 calls, once a process). A kernel
    launch that `captured_launches` records counts as one call, as a torch op's launch does
    (one builtin call): the recorder's own frames are this bench's, not the library's, and
    what Triton's launcher does in their place on a GPU is not Python a CPU can count (its
    binder's work grows with the kernel's arguments: `tests/kernels/test_host_overhead.py`
    holds their number)."""
    fn()
    fn()
    n = 0
    inside = None  # the recorder's frame being run, whose calls are not counted

    def count(frame, event, arg):
        nonlocal n, inside
        if inside is not None:
            if event == "return" and frame is inside:
                inside = None
            return
        if event == "call" and frame.f_code.co_filename == RECORDER_FILE:
            # kernel[grid](...): __getitem__, then the launch, one call together
            n += frame.f_code.co_name == "launch"
            inside = frame
        elif event == "call" or event == "c_call":
            n += 1

    sys.setprofile(count)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.setprofile(None)
    return (n - 1) / calls  # less the setprofile(None) call itself


def _op_calls(op: str, x, r, w, b):
    """(fused, naive): the op and its naive eager form, each (x, r, w, b) -> outputs."""
    d = x.shape[-1]
    if op == "add_norm":
        return (lambda: fuseblock.add_norm(x, r, w, eps=1e-6),
                lambda: (F.rms_norm(x + r, (d,), w, 1e-6), x + r))
    if op == "add_norm_layer":
        return (lambda: fuseblock.add_norm(x, r, w, b, kind="layer", eps=1e-6),
                lambda: (F.layer_norm(x + r, (d,), w, b, 1e-6), x + r))
    if op == "norm":
        return lambda: fuseblock.norm(x, w, eps=1e-6), lambda: F.rms_norm(x, (d,), w, 1e-6)
    if op == "norm_add":
        return (lambda: fuseblock.norm_add(x, r, w, eps=1e-6),
                lambda: r + F.rms_norm(x, (d,), w, 1e-6))
    raise ValueError(op)


OPS = ("add_norm", "add_norm_layer", "norm", "norm_add")


def _op_row(op: str, device: str, reps: int, calls: int) -> dict:
    cuda = device == "cuda"
    rows, d, dtype = (140, 4096, torch.bfloat16) if cuda else (8, 256, torch.bfloat16)
    torch.manual_seed(0)
    x = torch.randn(rows, d, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.randn(d, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(d, device=device, dtype=dtype, requires_grad=True)
    leaves = {"add_norm": [x, r, w], "add_norm_layer": [x, r, w, b], "norm": [x, w], "norm_add": [x, r, w]}[op]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # on the CPU this thread's CPU time: what other processes take of the cores is not counted
    clock = time.perf_counter if cuda else time.thread_time
    row = dict(op=op, path="ops", device=device, shape=f"{rows}x{d} bf16")
    for name, fn in zip(("", "eager_"), _op_calls(op, x, r, w, b), strict=True):
        def fwd(fn=fn):
            with torch.no_grad():
                fn()

        def fwd_bwd(fn=fn):
            outs = fn()
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.grad(outs, leaves, outs)

        for what, step in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            row[f"{name}{what}_calls"] = calls_per_call(step)
            row[f"{name}{what}_us"] = statistics.median(per_call_us(step, reps, calls, sync, clock))
    return row


def op_rows(device: str, quick: bool, ops=OPS) -> list[dict]:
    """One row per op: fwd and fwd+bwd host time and function calls per call, fuseblock's
    and the naive form's (`path="ops"` above). cuda: real launches; cpu: recorded."""
    reps, calls = (3, 100) if quick else (7, 200)
    if device == "cuda":
        return [_op_row(op, device, reps, calls) for op in ops]
    from fuseblock.kernels import launch, norm_add

    rows = []
    with kernels_on_cpu(), captured_launches(kernels, norm_add, launch) as launches:
        for op in ops:
            rows.append(_op_row(op, "cpu", reps, calls))
            launches.clear()
    return rows


def check(args) -> str | None:
    unknown = sorted(set(args.ops or ()) - set(OPS))
    return f"--ops: unknown {unknown}; choose from {list(OPS)}" if unknown else None


def run(args) -> list[dict]:
    """--ops: only those ops' rows (`path="ops"`); --device cuda (with a GPU) times them on it."""
    device = "cuda" if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    ops = op_rows(device, args.quick, args.ops or OPS)
    if args.ops:
        return ops
    reps, calls = (3, 100) if args.quick else (7, 500)
    rows = [_kind_row(kind, reps, calls) for kind in ("rms", "layer")]
    return rows + [_torch_path_row(kind, form, args.repeats, calls) for form in ("function", "module")
                   for kind in ("rms", "layer")] + ops
