"""`bench.py gpu`: bf16 add_norm bandwidth (compulsory bytes / time), forward and backward,
against eager torch, torch.compile and the peers found (`peers.py`: Liger-Kernel,
flash-attention, quack), in one process on the same inputs, with fuseblock / peer ratios
(`x_<peer>_<pass>`); and the small-row latency (140 x 4096, microseconds). Tables and
plots into --out (gpu.json, gpu_latency.json, peers.json). (The GPT step is `bench.py
gpt-step`.) --device cpu runs the same code at toy sizes, a smoke test for machines
without a GPU; with no GPU and --device cuda it reports the peers found and stops.

The fp8 rows (gpu_fp8.json): add_norm with its output written as fp8 (quant="fp8_row",
"mxfp8") by the norm's own launch, against norm-then-cast (add_norm in bf16, then the
torch path's cast `fuseblock.reference.fp8.quantize`), forward GB/s of the compulsory bytes, and
whether the fused codes and scales equal the unfused ones bit for bit (quant_from=bf16:
the unfused pipeline's rounding points).

The n-stream row (gpu_hyper.json): the mHC boundary, `hc_add_norm` at n = 4 (HYPER_SHAPE),
against DeepSeek-V4's unfused torch ops, eager and compiled, GB/s of compulsory bytes.

`fuseblock-deterministic` is fuseblock under torch.use_deterministic_algorithms(True):
the weight gradients' partial rows fixed by the shape, not the GPU (docs/serving.md),
with torch's fill of uninitialized memory off, so the row measures that order alone."""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fuseblock

from . import peers
from .common import cpu_bench, markdown

LATENCY_SHAPE = (140, 4096)  # a decode-time batch: launch and host costs, not bandwidth


def _naive(x, r, w, kind):
    p = x + r
    out = F.rms_norm(p, (p.shape[-1],), w, 1e-6) if kind == "rms" else F.layer_norm(p, (p.shape[-1],), w, None, 1e-6)
    return out, p


def _fwd_bwd_ms(fn, leaves, do_bench) -> tuple[float, float]:
    """Milliseconds of fn() -> its outputs, forward (no graph) and backward to the leaves."""
    with torch.no_grad():
        t_fwd = do_bench(fn, warmup=5, rep=25)
    outs = fn()
    grads = [torch.randn_like(t) for t in outs]
    t_bwd = do_bench(lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True), warmup=5, rep=25)
    return t_fwd, t_bwd


def _fwd_bwd_TBps(fn, x, r, w, nbytes: int, do_bench) -> tuple[float, float]:
    """Compulsory bytes / time of fn(x, r, w) -> (out, p), forward and backward."""
    t_fwd, t_bwd = _fwd_bwd_ms(lambda: fn(x, r, w), (x, r, w), do_bench)
    return nbytes / t_fwd / 1e9, nbytes / t_bwd / 1e9


def _add_ratios(row: dict, ours: str, others, unit: str) -> None:
    """row's x_<other>_<pass>: ours / other's figure, forward and backward, where both were
    measured (above 1, ours is faster)."""
    for name in others:
        for pas in ("fwd", "bwd"):
            mine, theirs = row.get(f"{ours}_{pas}_{unit}"), row.get(f"{name}_{pas}_{unit}")
            if name != ours and mine and theirs:
                row[f"x_{name}_{pas}"] = mine / theirs


@contextlib.contextmanager
def _deterministic(on: bool):
    """torch.use_deterministic_algorithms(on) for the block, without its NaN fill of every
    torch.empty (a cost of torch's, not of the fixed summation order being measured)."""
    import torch.utils.deterministic as det

    before = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(on)
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        det.fill_uninitialized_memory = before[1]


def _empty_cache(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:80]}"


def _bandwidth_row(kind: str, d: int, args, dev, do_bench, found: dict) -> dict:
    """One table row: each implementation's forward and backward TB/s at width d."""
    from torch import _dynamo

    dt = torch.bfloat16
    # A fresh static-shape compile per shape: one compiled function reused across
    # shapes turns dynamic after the first (automatic dynamic shapes), which
    # generates slower, shape-generic reductions and understates torch.compile.
    _dynamo.reset()
    compiled = None if args.no_compile else torch.compile(_naive, dynamic=False)
    M = min(args.rows[0] if args.rows else 32768, (1 << 29) // d)
    row = dict(kind=kind, d=d, rows=M)
    try:
        x = torch.randn(M, d, device=dev, dtype=dt, requires_grad=True)
        r = torch.randn(M, d, device=dev, dtype=dt, requires_grad=True)
        w = torch.ones(d, device=dev, dtype=dt, requires_grad=True)
    except RuntimeError as e:  # out of memory (torch.OutOfMemoryError is one)
        row["error"] = _error(e)
        return row
    # fwd: x, r in; out, p out. bwd: p, dout, dp in; dx (= dr) out. Weights excluded.
    nbytes = 4 * M * d * x.element_size()
    impls = {"fuseblock": lambda x, r, w: fuseblock.add_norm(x, r, w, kind=kind, eps=1e-6),
             "fuseblock-deterministic": lambda x, r, w: fuseblock.add_norm(x, r, w, kind=kind, eps=1e-6),
             "eager": lambda x, r, w: _naive(x, r, w, kind)}
    if compiled is not None:
        impls["compile"] = lambda x, r, w: compiled(x, r, w, kind)
    if dev.type == "cuda":
        impls.update(peers.norm_fns(kind, found))
    for name, fn in impls.items():
        try:
            with _deterministic(name == "fuseblock-deterministic"):
                row[f"{name}_fwd_TBps"], row[f"{name}_bwd_TBps"] = _fwd_bwd_TBps(fn, x, r, w, nbytes, do_bench)
        except Exception as e:  # a contender's failure of any kind (a Triton compile error too): in the table
            row[f"{name}_error"] = _error(e)
    _add_ratios(row, "fuseblock", impls, "TBps")
    return row


def _latency_row(kind: str, dev, do_bench, found: dict, quick_cpu: bool) -> dict:
    """Microseconds per call, forward and backward, at LATENCY_SHAPE (bf16), every contender."""
    M, d = (4, 64) if quick_cpu else LATENCY_SHAPE
    dt = torch.bfloat16
    x, r = (torch.randn(M, d, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
    w = torch.ones(d, device=dev, dtype=dt, requires_grad=True)
    impls = {"fuseblock": lambda x, r, w: fuseblock.add_norm(x, r, w, kind=kind, eps=1e-6),
             "eager": lambda x, r, w: _naive(x, r, w, kind)}
    if dev.type == "cuda":
        impls.update(peers.norm_fns(kind, found))
    row = dict(kind=kind, rows=M, d=d)
    for name, fn in impls.items():
        try:
            with torch.no_grad():
                row[f"{name}_fwd_us"] = do_bench(lambda fn=fn: fn(x, r, w), warmup=5, rep=25) * 1e3
            out, p = fn(x, r, w)
            g = (torch.randn_like(out), torch.randn_like(p))
            row[f"{name}_bwd_us"] = do_bench(
                lambda out=out, p=p, g=g: torch.autograd.grad((out, p), (x, r, w), g, retain_graph=True),
                warmup=5, rep=25) * 1e3
        except Exception as e:  # as in the bandwidth table
            row[f"{name}_error"] = _error(e)
    return row


FP8_SHAPE = (16384, 4096)  # bf16 rows of a training batch
FP8_MODES = ("fp8_row", "mxfp8")


def _fp8_row(mode: str, dev, do_bench, quick_cpu: bool) -> dict:
    """Fused add_norm + fp8 cast against norm-then-cast: forward GB/s of the compulsory
    bytes (x, residual read; new_residual, codes, scales written) and the codes' equality."""
    from dataclasses import replace

    from fuseblock.reference.fp8 import quantize
    from fuseblock.spec import NormSpec, Quant

    M, d = (32, 64) if quick_cpu else FP8_SHAPE
    row = dict(op=f"add_norm+{mode}", rows=M, d=d)
    try:
        x, r = (torch.randn(M, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        w = torch.ones(d, device=dev, dtype=torch.bfloat16)
        spec = replace(NormSpec(False, 1.0, 1e-6, 0, 0, 1), quant=Quant.ROW if mode == "fp8_row" else Quant.MX)

        def fused():
            return fuseblock.add_norm(x, r, w, eps=1e-6, quant=fuseblock.Fp8Recipe(mode, quant_from=torch.bfloat16))

        def unfused():
            out, p = fuseblock.add_norm(x, r, w, eps=1e-6)
            return quantize(out, spec), p

        with torch.no_grad():
            (qf, pf), (qu, pu) = fused(), unfused()
            nbytes = 3 * x.nbytes + qf.data.nbytes + qf.scale.nbytes
            for name, fn in (("fused", fused), ("unfused", unfused)):
                row[f"{name}_fwd_GBps"] = nbytes / do_bench(fn, warmup=5, rep=25) / 1e6
    except Exception as e:  # out of memory, or a failure of the op itself: in the table
        row["error"] = _error(e)
        return row
    row["x_unfused_fwd"] = row["fused_fwd_GBps"] / row["unfused_fwd_GBps"]
    # where they differ, how much: codes and scales that differ, and the widest code step
    codes_f, codes_u = qf.data.view(torch.uint8), qu.data.view(torch.uint8)
    row["codes_differ"] = int((codes_f != codes_u).sum())
    row["max_code_step"] = int((codes_f.int() - codes_u.int()).abs().max()) if codes_f.numel() else 0
    row["scales_differ"] = int((qf.scale.view(torch.uint8) != qu.scale.view(torch.uint8)).sum())
    row["codes_equal"] = row["codes_differ"] == row["scales_differ"] == 0 and bool(torch.equal(pf, pu))
    return row


HYPER_SHAPE = (8192, 4, 4096)  # tokens, streams, d: DeepSeek-V4's n = 4 at a 4096 hidden size


def _hyper_row(dev, do_bench, quick_cpu: bool) -> dict:
    """The mHC boundary (hc_add_norm with comb, 20 Sinkhorn passes, bf16 streams): GB/s of
    the compulsory bytes (`fuseblock.testing.hyper_traffic.minimum_bytes`), forward and
    backward, fused against the unfused torch form (DeepSeek-V4's ops) eager and compiled
    (not in the CPU smoke run: inductor's C++ build of 20 Sinkhorn passes is most of a minute)."""
    from torch import _dynamo

    from fuseblock.testing import hyper_traffic as ht

    M, n, d = (32, 4, 64) if quick_cpu else HYPER_SHAPE
    row = dict(op="hc_add_norm", tokens=M, n=n, d=d)
    _dynamo.reset()
    compiled = None if quick_cpu else torch.compile(lambda *a: ht.boundary(list(a), False), dynamic=False)
    try:
        with dev:
            inputs = ht.boundary_inputs(M, n, d, torch.bfloat16)
        leaves = [t for t in inputs if t is not None]
        outs = ht.boundary(inputs, True)
        fwd_bytes, bwd_bytes = ht.minimum_bytes(inputs, outs)
    except RuntimeError as e:  # out of memory
        row["error"] = _error(e)
        return row
    impls = {"fused": lambda: ht.boundary(inputs, True), "eager": lambda: ht.boundary(inputs, False)}
    if compiled is not None:
        impls["compile"] = lambda: compiled(*inputs)
    for name, fn in impls.items():
        try:
            t_fwd, t_bwd = _fwd_bwd_ms(fn, leaves, do_bench)
            row[f"{name}_fwd_GBps"], row[f"{name}_bwd_GBps"] = fwd_bytes / t_fwd / 1e6, bwd_bytes / t_bwd / 1e6
        except Exception as e:  # as in the bandwidth table
            row[f"{name}_error"] = _error(e)
    _add_ratios(row, "fused", impls, "GBps")
    return row


def run(args) -> list[dict]:
    dev = torch.device(args.device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    found = peers.find()
    (out_dir / "peers.json").write_text(json.dumps(found, indent=1))
    print("peers:\n" + peers.describe(found), flush=True)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: the gpu benchmark needs one (nothing to do)")
        return []
    import torch._functorch.config as fconfig

    if dev.type == "cuda":
        from triton.testing import do_bench
    else:
        do_bench = cpu_bench
    fconfig.donated_buffer = False  # the compiled backward is re-run with retain_graph
    ds = [args.d] if args.d else [1024, 4096, 16384, 65536, 262144] if args.quick else [1 << k for k in range(10, 19)]
    rows = []
    for kind in ("rms", "layer"):
        for d in ds:
            rows.append(_bandwidth_row(kind, d, args, dev, do_bench, found))
            _empty_cache(dev)
    latency = [_latency_row(kind, dev, do_bench, found, dev.type != "cuda") for kind in ("rms", "layer")]
    fp8 = [_fp8_row(mode, dev, do_bench, dev.type != "cuda") for mode in FP8_MODES]
    hyper = [_hyper_row(dev, do_bench, dev.type != "cuda")]
    (out_dir / "gpu.json").write_text(json.dumps(rows, indent=1))
    (out_dir / "gpu_hyper.json").write_text(json.dumps(hyper, indent=1))
    (out_dir / "gpu_latency.json").write_text(json.dumps(latency, indent=1))
    (out_dir / "gpu_fp8.json").write_text(json.dumps(fp8, indent=1))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (smoke run)"
    (out_dir / "gpu.md").write_text(f"# add_norm bandwidth, bf16, {name}, torch {torch.__version__}\n\n"
                                    + markdown(rows) + f"\n# latency at {LATENCY_SHAPE[0]} x {LATENCY_SHAPE[1]}, "
                                    "microseconds\n\n" + markdown(latency)
                                    + "\n# add_norm + fp8 cast, fused vs norm-then-cast, forward GB/s\n\n"
                                    + markdown(fp8) + "\n# the mHC boundary, fused vs unfused, GB/s\n\n"
                                    + markdown(hyper))
    _plot(rows, out_dir)
    return rows + latency + fp8 + hyper


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
        for ax, pas in zip(axes, ("fwd", "bwd"), strict=True):
            for name in names:
                pts = [(r["d"], r[f"{name}_{pas}_TBps"]) for r in sel if f"{name}_{pas}_TBps" in r]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"add_norm {kind} {pas}, bf16, M = min(32K, 2^29/d)")
            ax.set_xlabel("d")
            ax.set_ylabel("TB/s (compulsory bytes / time)")
            ax.legend()
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / f"gpu_{kind}.png")
        plt.close(fig)
