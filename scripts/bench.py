"""Benchmarks, each printing a markdown table (--json: one JSON row per line).

    python scripts/bench.py traffic [--quick]   bytes moved: Triton kernels (interpreter) vs naive eager vs minimum
    python scripts/bench.py memory  [--quick]   bytes saved for backward per layer per token, fused vs naive GPT
    python scripts/bench.py speed   [--quick] [--repeats N]  CPU training-step time: naive, fused, torch.compile of each
    python scripts/bench.py gpu     [--out DIR] GPU bandwidth and GPT step time (exits 0 without CUDA)
    python scripts/bench.py sm90    [--quick]   each kernel compiled for an H100 without one: registers, spills
    python scripts/bench.py overhead [--quick]  host-side (Python) time per call, kernels not run

Byte model for `traffic`: the compulsory minimum reads each external activation input once
and writes each activation output once (forward: x, residual, gate in; out, new_residual
out. Backward: the saved p, gate, grad_out, grad_new_residual in; dx, a separate
dresidual when its dtype differs, dgate out). Weights, biases, row statistics and the
per-program dw/db partial rows are reported apart, as "other".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if len(sys.argv) > 1 and sys.argv[1] == "traffic":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fuseblock  # noqa: E402

ACTIVATION_ARGS = {"X", "R", "Z", "O", "RO", "P", "DO", "DRO", "DX", "DR", "DZ"}
UNCACHED_ARGS = ACTIVATION_ARGS | {"RSTD", "MEAN", "DOT", "DW", "DB", "?"}  # all but the weights, which stay cached
OPS = ["norm", "add_norm", "add_norm_layer", "add_norm_fp32_residual", "pre_gate", "post_gate", "post_gate_residual"]


def markdown(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))  # rows may differ (gpu: error columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = (r.get(c, "") for c in cols)
        lines.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in cells) + " |")
    return "\n".join(lines) + "\n"


def emit(rows: list[dict], as_json: bool) -> None:
    if as_json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(markdown(rows))


# ------------------------------------------------------------------------------ traffic
def _op_inputs(op: str, rows: int, d: int, dtype):
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
    return x, residual, w, kw


def _leaves(x, residual, w, kw):
    return [t for t in (x, residual, w, kw.get("bias"), kw.get("gate")) if t is not None]


def _fused(op, x, residual, w, kw):
    if residual is None and "residual_dtype" not in kw:
        return fuseblock.norm(x, w, **kw), None
    return fuseblock.add_norm(x, residual, w, **kw)


class _OneKernelRMSNorm(torch.autograd.Function):
    """torch's rms_norm charged as one kernel each way, as CUDA runs it: forward reads x, w
    and writes out, rstd; backward reads grad_out, x, rstd, w and writes dx, dw."""

    @staticmethod
    def forward(ctx, x, w):
        from fuseblock.testing.traffic import charge, uncounted

        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        with uncounted():
            rstd = torch.rsqrt(x.to(acc).square().mean(-1, keepdim=True) + 1e-6)  # (M, 1)
            out = (x.to(acc) * rstd * w.to(acc)).to(x.dtype)
        charge("rms_norm (one kernel)", [x, w], [out, rstd])
        ctx.save_for_backward(x, w, rstd)
        return out

    @staticmethod
    def backward(ctx, dout):
        from fuseblock.testing.traffic import charge, uncounted

        x, w, rstd = ctx.saved_tensors
        with uncounted():
            r = x.to(rstd.dtype) * rstd
            dr = dout.to(rstd.dtype) * w.to(rstd.dtype)
            dx = (rstd * (dr - r * (dr * r).mean(-1, keepdim=True))).to(x.dtype)
            dw = (dout.to(rstd.dtype) * r).sum(0).to(w.dtype)
        charge("rms_norm_backward (one kernel)", [dout, x, rstd, w], [dx, dw])
        return dx, dw


def _naive(op, x, residual, w, kw, one_kernel_norm: bool = False):
    """The same function as eager torch: x + residual, then torch's own norm (and gate).
    one_kernel_norm: charge rms_norm as one kernel (CUDA) instead of the CPU's composite."""
    p = x if residual is None else (x.to(residual.dtype) + residual if "residual_dtype" in kw else x + residual)
    g = F.silu(kw["gate"]) if "gate" in kw else None
    s = p * g if kw.get("gate_position") == "pre" else p
    if kw.get("kind") == "layer":
        out = F.layer_norm(s, (s.shape[-1],), w.to(s.dtype), kw["bias"].to(s.dtype), 1e-6)
    elif one_kernel_norm:
        out = _OneKernelRMSNorm.apply(s, w.to(s.dtype))
    else:
        out = F.rms_norm(s, (s.shape[-1],), w.to(s.dtype), 1e-6)
    out = out.to(x.dtype)
    if kw.get("gate_position") == "post":
        out = out * g
    return out, (p if residual is not None else None)


def _minimum(x, residual, kw, out, new_res):
    """Compulsory (forward, backward) bytes: each activation in once, each out once."""
    gate = kw["gate"].nbytes if "gate" in kw else 0
    fwd_in = x.nbytes + (residual.nbytes if residual is not None else 0) + gate
    fwd_out = out.nbytes + (new_res.nbytes if new_res is not None else 0)
    p_bytes = new_res.nbytes if new_res is not None else x.nbytes
    bwd_in = p_bytes + out.nbytes + (new_res.nbytes if new_res is not None else 0) + gate
    separate = residual is not None and residual.dtype != x.dtype  # else dx is also dresidual
    bwd_out = x.nbytes + (residual.nbytes if separate else 0) + gate
    return fwd_in + fwd_out, bwd_in + bwd_out


def measure_traffic(op: str, rows: int, d: int, dtype) -> list[dict]:
    """Rows for fwd, bwd and fwd+bwd of one op: kernel, naive and minimum bytes."""
    from fuseblock.testing.traffic import EagerTraffic, KernelTraffic

    torch.manual_seed(0)
    x, residual, w, kw = _op_inputs(op, rows, d, dtype)
    leaves = _leaves(x, residual, w, kw)
    with KernelTraffic(glue=True) as kf:
        out, new_res = _fused(op, x, residual, w, kw)
    outs = [out] + ([new_res] if new_res is not None else [])
    grads = [torch.randn_like(t) for t in outs]
    with KernelTraffic(glue=True) as kb:
        torch.autograd.grad(outs, leaves, grads)
    with EagerTraffic() as nf:
        nouts = [t for t in _naive(op, x, residual, w, kw) if t is not None]
    with EagerTraffic() as nb:
        torch.autograd.grad(nouts, leaves, grads)
    with EagerTraffic() as n1f:
        nouts = [t for t in _naive(op, x, residual, w, kw, one_kernel_norm=True) if t is not None]
    with EagerTraffic() as n1b:
        torch.autograd.grad(nouts, leaves, grads)
    min_f, min_b = _minimum(x, residual, kw, out, new_res)

    def act(kt):
        return sum(v for ln in kt.launches for part in (ln.read, ln.written) for k, v in part.items() if k in ACTIVATION_ARGS)

    parts = {"fwd": ([kf], [nf], [n1f], min_f), "bwd": ([kb], [nb], [n1b], min_b),
             "fwd+bwd": ([kf, kb], [nf, nb], [n1f, n1b], min_f + min_b)}
    out_rows = []
    for pas, (kts, nts, n1s, mn) in parts.items():
        a = sum(map(act, kts))
        kernel = sum(k.bytes + k.glue_bytes for k in kts)
        uncached = sum(k.accessed(UNCACHED_ARGS) + k.glue_bytes for k in kts)
        naive, naive1 = sum(n.bytes for n in nts), sum(n.bytes for n in n1s)
        out_rows.append(dict(
            op=op, dtype=str(dtype).removeprefix("torch."), rows=rows, d=d, pas=pas,
            kernel_MB=kernel / 1e6, naive_MB=naive / 1e6, min_MB=mn / 1e6, other_MB=(kernel - a) / 1e6,
            kernel_over_min=kernel / mn, act_over_min=a / mn, uncached_over_min=uncached / mn,
            naive_over_kernel=naive / kernel, naive1_over_kernel=naive1 / kernel,
            launches=sum(len(k.launches) for k in kts), glue_ops=sum(len(k.glue.ops) for k in kts),
            naive_ops=sum(len(n.ops) for n in nts),
        ))
    return out_rows


def traffic(args) -> list[dict]:
    rows_list = args.rows or ([256, 2048] if args.quick else [256, 2048, 16384])
    d = args.d or (256 if args.quick else 1024)
    out_rows = []
    for op in args.ops or OPS:
        for dtype in (torch.float32, torch.bfloat16):
            if op == "add_norm_fp32_residual" and dtype == torch.float32:
                continue  # the same op as add_norm
            for rows in rows_list:
                out_rows += measure_traffic(op, rows, d, dtype)
                if not args.json:
                    print(f"  {op} {dtype} {rows}x{d} done", file=sys.stderr, flush=True)
    return out_rows


# ------------------------------------------------------------------------------ memory / speed
def _gpt(fused: bool, quick: bool, norm: str = "rms", n_layer: int | None = None):
    from models.gpt import GPT, GPTConfig

    n_layer = n_layer or (2 if quick else 4)
    cfg = GPTConfig(block_size=64, n_layer=n_layer, n_head=4, n_embd=64 if quick else 128, norm=norm, fused=fused)
    torch.manual_seed(0)
    return GPT(cfg)


def _saved(model, idx) -> tuple[int, int]:
    """(bytes, storages) of the distinct activation storages autograd keeps for backward
    (parameters excluded: they live anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
    del loss
    return sum(seen.values()), len(seen)


def memory(args) -> list[dict]:
    """Per layer = (saved with L2 layers - saved with L1 layers) / (L2 - L1): embedding,
    head and loss cancel out."""
    B, T = 4, 64
    l1, l2 = (1, 2) if args.quick else (1, 3)
    rows = []
    for norm in ("rms", "layer"):
        for fused in (False, True):
            idx = torch.randint(0, 256, (B, T))
            (b1, n1), (b2, n2) = (_saved(_gpt(fused, args.quick, norm, n), idx) for n in (l1, l2))
            dim = _gpt(fused, args.quick, norm, 1).config.n_embd
            per = (b2 - b1) / ((l2 - l1) * B * T)
            rows.append(dict(norm=norm, impl="fused" if fused else "naive", n_embd=dim,
                             bytes_per_layer_per_token=per, in_units_of_d_fp32=per / (4 * dim),
                             storages_per_layer=(n2 - n1) / (l2 - l1), total_saved_MB=b2 / 1e6))
    return rows


def speed(args) -> list[dict]:
    steps = 5 if args.quick else 20
    B = 8 if args.quick else 32
    impls = {}
    for fused in (False, True):
        model = _gpt(fused, args.quick)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        impls["fused" if fused else "naive"] = (model, opt)
        if not args.quick:
            impls[("fused" if fused else "naive") + "+compile"] = (torch.compile(model), opt)
    idx = torch.randint(0, 256, (B, 64))
    for k, (m, opt) in impls.items():  # warm up (and compile)
        m(idx, idx)[1].backward()
        opt.zero_grad()
    runs = {k: [] for k in impls}  # each run's median step time
    for _ in range(args.repeats):
        times = {k: [] for k in impls}
        for _ in range(steps):  # alternate, so drift hits every variant alike
            for k, (m, opt) in impls.items():
                t0 = time.perf_counter()
                m(idx, idx)[1].backward()
                opt.step()
                opt.zero_grad()
                times[k].append(time.perf_counter() - t0)
        for k, v in times.items():
            runs[k].append(statistics.median(v))
    rows = []
    for k, v in runs.items():
        up = [b / t for b, t in zip(runs["naive"], v)]  # against the naive median of the same run
        rows.append(dict(impl=k, runs=len(v), median_ms=statistics.median(v) * 1e3, min_ms=min(v) * 1e3,
                         max_ms=max(v) * 1e3, tokens_per_s=B * 64 / statistics.median(v),
                         speedup_vs_naive=statistics.median(up), speedup_min=min(up), speedup_max=max(up)))
    return rows


def overhead(args) -> list[dict]:
    """Host time per call with every kernel launch replaced by a recorder: the Python,
    allocation and autograd work a GPU host also does around each launch, which bounds
    small kernels (the backward at d = 1024 is ~100 us of GPU work on an H100). Measured
    with tiny CPU tensors, so allocation here stands in for the GPU caching allocator."""
    from fuseblock.kernels import norm as kernels
    from fuseblock.ops import norm as ops
    from fuseblock.ops.checks import resolve
    from fuseblock.testing.sm90 import captured_launches

    reps, calls = (3, 100) if args.quick else (7, 500)
    out_rows = []
    for kind in ("rms", "layer"):
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
        backend = ops._backend
        ops._backend = lambda t: kernels  # the Triton path for CPU tensors; its kernels only recorded
        try:
            with captured_launches(kernels):
                for name, fn in (("launcher_fwd_us", launcher_fwd), ("launcher_bwd_us", launcher_bwd),
                                 ("eager_fwd_bwd_us", eager_step)):
                    fn()
                    best = float("inf")
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            fn()
                        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
                    row[name] = best
        finally:
            ops._backend = backend
        out_rows.append(row)
    return out_rows


# ------------------------------------------------------------------------------ gpu
def _others(kind: str, d: int, dt):
    """Published kernels, when installed: name -> fn(x, r, w) returning (out, x + r)."""
    found = {}
    try:
        from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm

        mod = (LigerRMSNorm(d, eps=1e-6) if kind == "rms" else LigerLayerNorm(d, eps=1e-6)).to("cuda", dt)

        def liger(x, r, w):
            p = x + r
            return mod(p), p

        found["liger"] = liger
    except Exception:  # not installed, or an API we do not know
        pass
    try:
        from flash_attn.ops.triton.layer_norm import layer_norm_fn

        def flash(x, r, w):
            return layer_norm_fn(x, w, None, residual=r, eps=1e-6, prenorm=True, is_rms_norm=kind == "rms")

        found["flash_attn"] = flash
    except Exception:
        pass
    return found


def _cpu_bench(fn, warmup=1, rep=3, grad_to_none=None) -> float:
    """Median ms of a few calls: do_bench's stand-in for the CPU smoke run of `gpu`."""
    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _gpt_step_ms(fused: bool, do_bench, dev) -> float:
    from models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    shape = dict(block_size=1024, n_layer=12, n_head=12, n_embd=768) if dev.type == "cuda" else \
        dict(block_size=32, n_layer=1, n_head=2, n_embd=32)  # the CPU smoke run
    cfg = GPTConfig(fused=fused, **shape)
    model = GPT(cfg).to(dev, torch.bfloat16)
    idx = torch.randint(0, cfg.vocab_size, (8, cfg.block_size), device=dev)

    def step():
        model(idx, idx)[1].backward()

    return do_bench(step, warmup=3, rep=20, grad_to_none=list(model.parameters()))


def _fwd_bwd_TBps(fn, x, r, w, nbytes: int, do_bench) -> tuple[float, float]:
    """Compulsory bytes / time of fn(x, r, w) -> (out, p), forward and backward."""
    with torch.no_grad():
        t_fwd = do_bench(lambda: fn(x, r, w), warmup=5, rep=25)
    out, p = fn(x, r, w)
    grads = (torch.randn_like(out), torch.randn_like(p))
    t_bwd = do_bench(lambda: torch.autograd.grad((out, p), (x, r, w), grads, retain_graph=True), warmup=5, rep=25)
    return nbytes / t_fwd / 1e9, nbytes / t_bwd / 1e9


def _empty_cache(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def gpu(args) -> list[dict]:
    """bf16 add_norm bandwidth (compulsory bytes / time) against eager torch, torch.compile
    and published kernels; the GPT step time; table and plots into --out.
    --device cpu runs the same code at toy sizes, a smoke test for machines without a GPU."""
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: the gpu benchmark needs one (nothing to do)")
        return []
    import torch._functorch.config as fconfig
    from torch import _dynamo

    if dev.type == "cuda":
        from triton.testing import do_bench
    else:
        do_bench = _cpu_bench
    fconfig.donated_buffer = False  # the compiled backward is re-run with retain_graph
    dt = torch.bfloat16
    rows = []

    def naive(x, r, w, kind):
        p = x + r
        out = F.rms_norm(p, (p.shape[-1],), w, 1e-6) if kind == "rms" else F.layer_norm(p, (p.shape[-1],), w, None, 1e-6)
        return out, p

    ds = [args.d] if args.d else [1024, 4096, 16384, 65536, 262144] if args.quick else [1 << k for k in range(10, 19)]
    for kind in ("rms", "layer"):
        for d in ds:
            # A fresh static-shape compile per shape: one compiled function reused across
            # shapes turns dynamic after the first (automatic dynamic shapes), which
            # generates slower, shape-generic reductions and understates torch.compile.
            _dynamo.reset()
            compiled = None if args.no_compile else torch.compile(naive, dynamic=False)
            M = min(args.rows[0] if args.rows else 32768, (1 << 29) // d)
            row = dict(kind=kind, d=d, rows=M)
            try:
                x = torch.randn(M, d, device=dev, dtype=dt, requires_grad=True)
                r = torch.randn(M, d, device=dev, dtype=dt, requires_grad=True)
                w = torch.ones(d, device=dev, dtype=dt, requires_grad=True)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
                rows.append(row)
                continue
            # fwd: x, r in; out, p out. bwd: p, dout, dp in; dx (= dr) out. Weights excluded.
            nbytes = 4 * M * d * x.element_size()
            impls = {"fuseblock": lambda x, r, w: fuseblock.add_norm(x, r, w, kind=kind, eps=1e-6),
                     "eager": lambda x, r, w: naive(x, r, w, kind)}
            if compiled is not None:
                impls["compile"] = lambda x, r, w: compiled(x, r, w, kind)
            if dev.type == "cuda":
                impls.update(_others(kind, d, dt))
            for name, fn in impls.items():
                try:
                    row[f"{name}_fwd_TBps"], row[f"{name}_bwd_TBps"] = _fwd_bwd_TBps(fn, x, r, w, nbytes, do_bench)
                except Exception as e:  # report it in the table, keep going
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:80]}"
            rows.append(row)
            del x, r, w
            _empty_cache(dev)
    steps = {}
    for fused in (False, True):
        try:
            steps["fused" if fused else "naive"] = _gpt_step_ms(fused, do_bench, dev)
            _empty_cache(dev)
        except Exception as e:
            steps[("fused" if fused else "naive") + "_error"] = f"{type(e).__name__}: {str(e)[:80]}"
    step_rows = [dict(kind="gpt_step_ms", **steps)]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu.json").write_text(json.dumps(rows + step_rows, indent=1))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (smoke run)"
    (out_dir / "gpu.md").write_text(f"# add_norm bandwidth, bf16, {name}, torch {torch.__version__}\n\n"
                                    + markdown(rows) + "\n# GPT-2 small shape step (fwd+bwd), ms\n\n" + markdown(step_rows))
    _plot(rows, out_dir)
    return rows + step_rows


def sm90(args) -> list[dict]:
    """Compile every kernel the launchers pick for bf16 add_norm (rms; layer with bias)
    for an H100 (sm_90) with Triton's compiler and ptxas: no GPU needed. Reports what
    the cubin uses per thread (registers; stack, where spilled registers go, through
    L1 and L2), the programs an SM holds at once, and the grid in waves of those, on
    the first launch (default programs per SM) and once the launch has learned what
    fits (`fuseblock.kernels.occupancy`): a persistent kernel wants at most 1."""
    import math
    from types import SimpleNamespace

    from fuseblock.kernels import occupancy
    from fuseblock.kernels.norm import H100_SMS
    from fuseblock.testing.sm90 import compile_sm90, norm_launches, resource_usage

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sm90 needs triton's compiler: unset TRITON_INTERPRET")
    widths = [args.d] if args.d else ([1024, 65536] if args.quick else [256, 1024, 4096, 16384, 32768, 65536, 262144])
    out_rows = []
    for d in widths:
        rows = min(32768, (1 << 29) // d)  # as `gpu` does: the grids are the benchmark's
        x = torch.empty(rows, d, dtype=torch.bfloat16)
        w = torch.empty(d, dtype=torch.bfloat16)
        for kind in ("rms", "layer"):
            usage = {}

            def compiled(ln):  # as a GPU launch returns its compiled kernel, registers known
                t0 = time.perf_counter()
                kernel = compile_sm90(ln)
                usage[ln.name] = dict(resource_usage(kernel), compile_s=time.perf_counter() - t0)
                return SimpleNamespace(n_regs=usage[ln.name]["registers"], metadata=kernel.metadata)

            inputs = (x, torch.empty_like(x), w, w if kind == "layer" else None)
            occupancy._RESIDENT.clear()
            first = norm_launches(*inputs, kind=kind, compiled=compiled)
            learned = {ln.name: ln for ln in norm_launches(*inputs, kind=kind)}
            for ln in first:
                u = usage[ln.name]
                warps = ln.kwargs.get("num_warps", 4)
                slots = H100_SMS * occupancy.resident_programs(u, warps)
                block = "x".join(str(ln.kwargs[k]) for k in ("BR", "BG", "BD") if k in ln.kwargs)
                out_rows.append(dict(
                    kind=kind, d=d, rows=rows, kernel=ln.name, block=block, num_warps=warps,
                    registers=u["registers"], stack=u["stack"], shared=u["shared"], resident_per_sm=slots // H100_SMS,
                    grid_first="x".join(map(str, ln.grid)), waves_first=math.prod(ln.grid) / slots,
                    grid="x".join(map(str, learned[ln.name].grid)), waves=math.prod(learned[ln.name].grid) / slots,
                    compile_s=u["compile_s"],
                ))
            if not args.json:
                print(f"  {kind} d={d} done", file=sys.stderr, flush=True)
    return out_rows


def _plot(rows, out_dir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return
    names = sorted({k.rsplit("_", 2)[0] for r in rows for k in r if k.endswith("_TBps")})
    for kind in ("rms", "layer"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        sel = [r for r in rows if r["kind"] == kind]
        for ax, pas in zip(axes, ("fwd", "bwd")):
            for name in names:
                pts = [(r["d"], r[f"{name}_{pas}_TBps"]) for r in sel if f"{name}_{pas}_TBps" in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"add_norm {kind} {pas}, bf16, M = min(32K, 2^29/d)")
            ax.set_xlabel("d")
            ax.set_ylabel("TB/s (compulsory bytes / time)")
            ax.legend()
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / f"gpu_{kind}.png")
        plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["traffic", "memory", "speed", "gpu", "sm90", "overhead"])
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument("--out", default="out/bench", help="gpu: where the table and plots go")
    ap.add_argument("--device", default="cuda", help="gpu: the device; cpu runs a toy-size smoke test of the code")
    ap.add_argument("--no-compile", action="store_true", help="gpu: skip the torch.compile baseline")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1, help="speed: independent runs of all the steps (median, min, max)")
    ap.add_argument("--ops", type=lambda v: v.split(","), default=None, help=f"traffic: a comma list of {OPS}")
    ap.add_argument("--rows", type=lambda v: [int(r) for r in v.split(",")], default=None, help="traffic: row counts")
    ap.add_argument("--d", type=int, default=None, help="traffic, sm90: row width")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.ops and set(args.ops) - set(OPS):
        ap.error(f"--ops: unknown {sorted(set(args.ops) - set(OPS))}; choose from {OPS}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = {"traffic": traffic, "memory": memory, "speed": speed, "gpu": gpu, "sm90": sm90, "overhead": overhead}[args.what](args)
    if rows:
        emit(rows, args.json)


if __name__ == "__main__":
    main()
