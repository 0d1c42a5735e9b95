"""Benchmarks. Each prints markdown tables; --json prints one JSON object per row instead.

    python scripts/bench.py traffic [--quick] [--rows N ..] [--d D ..] [--kinds rms layer] [--dtypes fp32 bf16]
    python scripts/bench.py memory  [--quick]
    python scripts/bench.py speed   [--quick] [--steps N] [--no-compile]
    python scripts/bench.py gpu     [--quick] [--out DIR] [--no-compile]

traffic: bytes moved by the Triton kernels (run by the interpreter, on the grid of an
  H100), by the naive eager composition, and the compulsory minimum (byte model:
  fuseblock/testing/cases.py). This subcommand sets TRITON_INTERPRET=1 itself.
memory: bytes the GPT saves for backward per layer per token, fused against naive.
speed: CPU training-step time of the GPT: naive, fused, and torch.compile of each.
gpu: bandwidth of add_norm forward and backward against eager PyTorch, torch.compile,
  Liger-Kernel and flash-attn when installed; GPT step time; tables and PNGs in --out.
  Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("traffic", "memory", "speed", "gpu")


def _select_backend(argv) -> None:
    # The interpreter is chosen when triton is imported: decide before any import of torch.
    command = next((a for a in argv if not a.startswith("-")), None)
    if command == "traffic":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)


_select_backend(sys.argv[1:])
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fuseblock  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MB = 1e6


# --------------------------------------------------------------------------- output
def table(title: str, rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """A markdown table of `rows`; cols are (header, key, format spec)."""
    lines = [f"### {title}", "", "| " + " | ".join(h for h, _, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for _, key, spec in cols:
            v = r.get(key)
            cells.append("-" if v is None else format(v, spec) if spec else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def emit(args, rows: list[dict], tables: list[str]) -> None:
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print("\n".join(tables))


def dtype_name(dt: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dt)


# --------------------------------------------------------------------------- traffic
def _traffic_case(case) -> list[dict]:
    """Forward and backward rows for one case: fused (kernels + torch glue) and naive."""
    from fuseblock.testing import cases as C
    from fuseblock.testing.traffic import EagerTraffic, KernelTraffic

    with KernelTraffic() as kf, EagerTraffic() as gf:
        outs = case.fused()
    grads = case.grad_outputs(outs)
    with KernelTraffic() as kb, EagerTraffic() as gb:
        torch.autograd.grad(outs, case.leaves, grads)
    with EagerTraffic() as nf:
        nouts = case.naive()
    with EagerTraffic() as nb:
        torch.autograd.grad(nouts, case.leaves, grads)
    with EagerTraffic() as n1f:
        nouts = case.naive(one_kernel_norm=True)
    with EagerTraffic() as n1b:
        torch.autograd.grad(nouts, case.leaves, grads)
    rows = []
    for pas, kern, glue, naive, naive1, minimum in zip(
        ("fwd", "bwd"), (kf, kb), (gf, gb), (nf, nb), (n1f, n1b), case.minimum()
    ):
        act = kern.bytes_of(C.ACTIVATION_ARGS)
        fused = kern.bytes + glue.bytes
        rows.append(dict(
            op=case.op, kind=case.kind, dtype=dtype_name(case.x.dtype), rows=case.x.shape[0], d=case.x.shape[1],
            min_bytes=minimum, kernel_act_bytes=act,
            kernel_weight_bytes=kern.bytes_of(C.WEIGHT_ARGS), kernel_stat_bytes=kern.bytes_of(C.STAT_ARGS),
            kernel_partial_bytes=kern.bytes_of(C.PARTIAL_ARGS), unattributed_bytes=kern.unattributed,
            glue_bytes=glue.bytes, fused_bytes=fused, naive_bytes=naive.bytes, naive1_bytes=naive1.bytes,
            act_accessed_bytes=kern.accessed_of(C.ACTIVATION_ARGS),
            launches=kern.count(), glue_ops=[op.name for op in glue.ops], naive_ops=naive.count(),
            act_over_min=act / minimum, fused_over_min=fused / minimum, naive_over_min=naive.bytes / minimum,
            naive_over_fused=naive.bytes / fused, naive1_over_fused=naive1.bytes / fused, uncached_over_min=kern.accessed_of(C.ACTIVATION_ARGS) / minimum,
        ))
        rows[-1]["pass"] = pas
    return rows


def traffic(args) -> tuple[list[dict], list[str]]:
    from fuseblock.testing import cases as C

    rows_list = args.rows or ([256] if args.quick else [256, 2048, 16384])
    ds = args.d or ([128] if args.quick else [1024])
    kinds = args.kinds or (["rms", "layer"] if args.quick else ["rms"])
    dtypes = [DTYPES[n] for n in (args.dtypes or ["fp32", "bf16"])]
    out = []
    for kind in kinds:
        for op in C.OPS:
            for dtype in dtypes:
                if op == "add_norm_fp32_residual" and dtype == torch.float32:
                    continue  # the same as add_norm
                for d in ds:
                    for rows in rows_list:
                        out += _traffic_case(C.make_case(op, rows, d, dtype, kind))
    for r in out:
        r["min_MB"], r["fused_MB"], r["naive_MB"] = r["min_bytes"] / MB, r["fused_bytes"] / MB, r["naive_bytes"] / MB
        r["launches_str"] = f"{r['launches']}+{len(r['glue_ops'])}"
    per_pass = table("traffic per pass (MB; fused = Triton kernels + torch glue)", out, [
        ("op", "op", ""), ("kind", "kind", ""), ("dtype", "dtype", ""), ("rows", "rows", ""), ("d", "d", ""),
        ("pass", "pass", ""), ("min MB", "min_MB", ".4g"), ("fused MB", "fused_MB", ".4g"),
        ("act/min", "act_over_min", ".3f"), ("fused/min", "fused_over_min", ".3f"),
        ("uncached/min", "uncached_over_min", ".3f"), ("naive MB", "naive_MB", ".4g"),
        ("naive/min", "naive_over_min", ".2f"), ("naive/fused", "naive_over_fused", ".2f"),
        ("naive1/fused", "naive1_over_fused", ".2f"), ("launches", "launches_str", ""), ("naive ops", "naive_ops", ""),
    ])
    both = []
    for f, b in zip(out[::2], out[1::2]):
        mn, fu, na, n1 = (f[k] + b[k] for k in ("min_bytes", "fused_bytes", "naive_bytes", "naive1_bytes"))
        both.append(dict(op=f["op"], kind=f["kind"], dtype=f["dtype"], rows=f["rows"], d=f["d"], fused_over_min=fu / mn,
                         naive_over_min=na / mn, naive_over_fused=na / fu, naive1_over_fused=n1 / fu))
    total = table("forward + backward", both, [
        ("op", "op", ""), ("kind", "kind", ""), ("dtype", "dtype", ""), ("rows", "rows", ""), ("d", "d", ""),
        ("fused/min", "fused_over_min", ".3f"), ("naive/min", "naive_over_min", ".2f"),
        ("naive/fused", "naive_over_fused", ".2f"), ("naive1/fused", "naive1_over_fused", ".2f"),
    ])
    return out, [per_pass, total]


# --------------------------------------------------------------------------- models
def _gpt(n_layer: int, fused: bool, norm: str, quick: bool, residual_dtype=None, **over):
    from models.gpt import GPT, GPTConfig

    cfg = dict(block_size=64, n_layer=n_layer, n_head=4, n_embd=64 if quick else 128, norm=norm, fused=fused,
               residual_dtype=residual_dtype)
    cfg.update(over)
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg))


def _saved_bytes(model, idx, autocast: bool) -> dict:
    """Bytes of the unique storages autograd saves, by where they are saved:
    inside an attention/MLP mixer, elsewhere in the residual stack (norms and adds),
    or outside the stack. Parameters are not counted."""
    from models.gpt import MLP, CausalSelfAttention

    params = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    where = ["other"]  # a stack: the category of each module being run

    def enter(m, _):
        where.append("mixers" if isinstance(m, (CausalSelfAttention, MLP)) else "norms" if m is model.stack else where[-1])

    def leave(*_):
        where.pop()

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    seen: dict = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.data_ptr() not in seen:
            seen[st.data_ptr()] = (where[-1], st.nbytes())
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            model(idx, idx)
    finally:
        for h in handles:
            h.remove()
    out = {"norms": 0, "mixers": 0, "other": 0}
    for cat, n in seen.values():
        out[cat] += n
    return out


def memory(args) -> tuple[list[dict], list[str]]:
    """Saved bytes per layer per token, by a double difference over depth and batch, so
    per-model and per-layer constants (the embedding, the head, autocast's weight
    copies) drop out."""
    T = 64
    (l1, l2), (b1, b2) = (1, 2), (2, 4)
    out = []
    for norm in ("rms", "layer"):
        for precision in ("fp32", "bf16-autocast"):
            auto = precision != "fp32"
            per = {}
            for impl in ("naive", "fused"):
                s = {}
                for L in (l1, l2):
                    model = _gpt(L, impl == "fused", norm, args.quick, torch.float32 if auto else None)
                    for B in (b1, b2):
                        idx = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
                        s[L, B] = _saved_bytes(model, idx, auto)
                per[impl] = {k: (s[l2, b2][k] - s[l1, b2][k] - s[l2, b1][k] + s[l1, b1][k]) / ((l2 - l1) * (b2 - b1) * T)
                             for k in ("norms", "mixers", "other")}
                per[impl]["total"] = sum(per[impl].values())
            d = model.config.n_embd
            for impl in ("naive", "fused"):
                p = per[impl]
                out.append(dict(norm=norm, precision=precision, impl=impl, n_embd=d, bytes_per_layer_token=p["total"],
                                norm_bytes=p["norms"], mixer_bytes=p["mixers"], per_channel=p["total"] / d,
                                norm_per_channel=p["norms"] / d, fused_over_naive=p["total"] / per["naive"]["total"]))
    t = table(f"bytes saved for backward per layer per token (GPT, n_embd {out[0]['n_embd']}; per channel = / n_embd)", out, [
        ("norm", "norm", ""), ("precision", "precision", ""), ("impl", "impl", ""),
        ("bytes", "bytes_per_layer_token", ".0f"), ("per channel", "per_channel", ".2f"),
        ("norms + adds", "norm_bytes", ".0f"), ("norms per channel", "norm_per_channel", ".2f"),
        ("mixers", "mixer_bytes", ".0f"), ("vs naive", "fused_over_naive", ".3f"),
    ])
    return out, [t]


def _step_timer(variants: dict, idx, steps: int, warmup: int, sync=lambda: None, autocast=None) -> dict:
    """Median seconds per training step of each (model, optimizer), run alternately."""
    import contextlib

    def step(model, opt):
        with autocast() if autocast else contextlib.nullcontext():
            _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for model, opt in variants.values():
        for _ in range(warmup):
            step(model, opt)
    times = {k: [] for k in variants}
    for _ in range(steps):  # alternate, so any drift of the machine hits every variant alike
        for k, (model, opt) in variants.items():
            sync()
            t0 = time.perf_counter()
            step(model, opt)
            sync()
            times[k].append(time.perf_counter() - t0)
    return times


def _gpt_variants(make, compile_too: bool) -> dict:
    """naive, fused (and compiled twins): separate models with the same initial weights."""
    variants = {}
    for impl in ("naive", "fused"):
        model = make(impl == "fused")
        variants[impl] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    if compile_too:
        for impl in ("naive", "fused"):
            model = make(impl == "fused")
            variants[impl + "+compile"] = (torch.compile(model), torch.optim.AdamW(model.parameters(), lr=1e-4))
    return variants


def speed(args) -> tuple[list[dict], list[str]]:
    steps = args.steps or (3 if args.quick else 20)
    B, T = (8, 64) if args.quick else (32, 64)
    n_layer = 2 if args.quick else 4
    compile_too = not (args.quick or args.no_compile)
    variants = _gpt_variants(lambda fused: _gpt(n_layer, fused, "rms", args.quick), compile_too)
    idx = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    times = _step_timer(variants, idx, steps, warmup=1 if args.quick else 2)
    base = statistics.median(times["naive"])
    out = [dict(impl=k, median_ms=statistics.median(v) * 1e3, min_ms=min(v) * 1e3, max_ms=max(v) * 1e3,
                tokens_per_s=B * T / statistics.median(v), speedup_vs_naive=base / statistics.median(v), steps=len(v),
                threads=torch.get_num_threads())
           for k, v in times.items()]
    m = variants["naive"][0].config
    t = table(f"CPU training step (GPT {m.n_layer} layers, n_embd {m.n_embd}, batch {B} x {T}, fp32, "
              f"median of {steps} alternating steps, {torch.get_num_threads()} threads)", out, [
        ("impl", "impl", ""), ("median ms", "median_ms", ".1f"), ("min ms", "min_ms", ".1f"),
        ("max ms", "max_ms", ".1f"), ("tokens/s", "tokens_per_s", ".0f"), ("speedup vs naive", "speedup_vs_naive", ".3f"),
    ])
    return out, [t]


# --------------------------------------------------------------------------- gpu
GPU_ELEMS = 1 << 30  # rows x d cap per tensor: M = 32K rows up to d = 32K, fewer beyond


def _gpu_impls(kind: str, d: int, eps: float, compile_too: bool, dev: torch.device) -> dict:
    """name -> fn(x, r, w, b) -> (out, new_residual) for add_norm; unavailable ones absent."""

    def naive(x, r, w, b):
        p = x + r
        out = F.rms_norm(p, (d,), w, eps) if kind == "rms" else F.layer_norm(p, (d,), w, b, eps)
        return out, p

    impls = {"fuseblock": lambda x, r, w, b: fuseblock.add_norm(x, r, w, b, kind=kind, eps=eps), "eager": naive}
    if compile_too:
        impls["compile"] = torch.compile(naive, dynamic=False)
    if dev.type != "cuda":
        return impls
    try:  # flash-attn's fused residual + norm
        from flash_attn.ops.triton.layer_norm import layer_norm_fn

        impls["flash_attn"] = lambda x, r, w, b: layer_norm_fn(
            x, w, b, residual=r, eps=eps, prenorm=True, is_rms_norm=kind == "rms")
    except Exception:
        pass
    try:  # Liger-Kernel: its fused add + RMSNorm when it has one, else the add then its norm
        if kind == "rms":
            try:
                from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm

                mod = LigerFusedAddRMSNorm(d, eps=eps).to(dev)
                impls["liger"] = lambda x, r, w, b: _with_params(mod, w, None, lambda: mod(x, r))
            except ImportError:
                from liger_kernel.transformers.rms_norm import LigerRMSNorm

                mod = LigerRMSNorm(d, eps=eps).to(dev)
                impls["liger"] = lambda x, r, w, b: _with_params(mod, w, None, lambda: _add_then(mod, x, r))
        else:
            from liger_kernel.transformers.layer_norm import LigerLayerNorm

            mod = LigerLayerNorm(d, eps=eps).to(dev)
            impls["liger"] = lambda x, r, w, b: _with_params(mod, w, b, lambda: _add_then(mod, x, r))
    except Exception:
        pass
    return impls


def _with_params(mod, w, b, fn):
    # the benchmark's own parameters, so their gradients are part of the measured work
    mod.weight = w
    if b is not None and getattr(mod, "bias", None) is not None:
        mod.bias = b
    return fn()


def _add_then(mod, x, r):
    p = x + r
    return mod(p), p


def _time_ms(fn, dev: torch.device) -> float:
    if dev.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=30)
    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _copy_tbps(dev: torch.device, n: int) -> float:
    """Copy bandwidth (read + write) of n bf16 elements: the practical ceiling of a
    memory-bound kernel."""
    src = torch.empty(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), dev)
    return 2 * 2 * n / ms / 1e9


def _empty_cache(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _bandwidth(args, compile_too: bool, dev: torch.device) -> list[dict]:
    eps, dt = 1e-6, torch.bfloat16
    ds = args.d or ([1024, 8192, 65536, 262144] if args.quick else [1 << k for k in range(10, 19)])
    max_rows = args.rows[0] if args.rows else 32768
    out = []
    for kind in ("rms", "layer"):
        for d in ds:
            M = min(max_rows, max(1, GPU_ELEMS // d))
            torch._dynamo.reset()  # a fresh compile per shape, never the recompile limit's eager fallback
            impls = _gpu_impls(kind, d, eps, compile_too, dev)
            gen = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(M, d, device=dev, dtype=dt, generator=gen).requires_grad_()
            r = torch.randn(M, d, device=dev, dtype=dt, generator=gen).requires_grad_()
            w = torch.ones(d, device=dev, dtype=dt).requires_grad_()
            b = torch.zeros(d, device=dev, dtype=dt).requires_grad_() if kind == "layer" else None
            leaves = [t for t in (x, r, w, b) if t is not None]
            nbytes = 4 * M * d * dt.itemsize  # fwd: x, r in; out, new_res out. bwd: p, dout, dres in; dx out
            for name, fn in impls.items():
                row = dict(kind=kind, d=d, rows=M, impl=name, bytes=nbytes)
                outs = grads = None
                try:
                    with torch.no_grad():
                        row["fwd_ms"] = _time_ms(lambda: fn(x, r, w, b), dev)
                    outs = list(fn(x, r, w, b))
                    grads = [torch.randn_like(t) for t in outs]
                    row["bwd_ms"] = _time_ms(lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True), dev)
                except Exception as e:  # out of memory, an unsupported width: say so, go on
                    msg = str(e).splitlines()[0][:100] if str(e) else ""
                    row["error"] = f"{type(e).__name__}: {msg}"
                for p in ("fwd", "bwd"):
                    if f"{p}_ms" in row:
                        row[f"{p}_TBps"] = nbytes / row[f"{p}_ms"] / 1e9
                out.append(row)
                outs = grads = None
                _empty_cache(dev)
            del x, r, w, b, leaves
            _empty_cache(dev)
    return out


def _plots(rows: list[dict], out_dir: Path, copy_tbps: float) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        sel = [r for r in rows if r["kind"] == kind]
        for ax, pas in zip(axes, ("fwd", "bwd")):
            for name in dict.fromkeys(r["impl"] for r in sel):
                pts = [(r["d"], r[f"{pas}_TBps"]) for r in sel if r["impl"] == name and f"{pas}_TBps" in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name)
            ax.axhline(copy_tbps, color="gray", ls="--", lw=1, label="device copy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"add_norm ({kind}) {pas}, bf16")
            ax.set_xlabel("d (row width)")
            ax.set_ylabel("TB/s (compulsory bytes / time)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"gpu_{kind}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(str(path))
    return files


def _gpu_gpt(args, compile_too: bool, dev: torch.device) -> list[dict]:
    """End-to-end GPT training step: bf16 autocast, fp32 residual stream, LayerNorm."""
    if dev.type != "cuda":  # a smoke run of this code path
        over, B = dict(n_layer=1, n_head=2, n_embd=64, block_size=64), 2
    elif args.quick:
        over, B = dict(n_layer=4, n_head=4, n_embd=256, block_size=256), 8
    else:  # GPT-2 small
        over, B = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024), 8
    T = over["block_size"]

    def make(fused):
        return _gpt(over["n_layer"], fused, "layer", False, torch.float32,
                    **{k: v for k, v in over.items() if k != "n_layer"}).to(dev)

    variants = _gpt_variants(make, compile_too)
    idx = torch.randint(0, 256, (B, T), device=dev, generator=torch.Generator(device=dev).manual_seed(0))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    steps = 3 if dev.type != "cuda" else 5 if args.quick else 20
    times = _step_timer(variants, idx, steps=steps, warmup=3, sync=sync,
                        autocast=lambda: torch.autocast(dev.type, dtype=torch.bfloat16))
    peak = {}
    if dev.type == "cuda":  # peak memory of one more step each, alone
        for k, v in variants.items():
            torch.cuda.reset_peak_memory_stats()
            _step_timer({k: v}, idx, steps=1, warmup=0, sync=sync,
                        autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16))
            peak[k] = torch.cuda.max_memory_allocated() / 2**20
    base = statistics.median(times["naive"])
    return [dict(impl=k, median_ms=statistics.median(v) * 1e3, tokens_per_s=B * T / statistics.median(v),
                 speedup_vs_naive=base / statistics.median(v), peak_MiB=peak.get(k), n_layer=over["n_layer"],
                 n_embd=over["n_embd"], batch=B, block=T)
            for k, v in times.items()]


def gpu(args) -> tuple[list[dict], list[str]]:
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: the gpu benchmark needs one; nothing to do")
        return [], []
    import torch._functorch.config as fconfig
    from torch import _dynamo  # noqa: F401 (loads torch._dynamo, for its reset())

    fconfig.donated_buffer = False  # the compiled backward is re-run with retain_graph
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    compile_too = not args.no_compile
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (smoke run)"
    copy_tbps = _copy_tbps(dev, 1 << 29 if dev.type == "cuda" else 1 << 20)
    bw = _bandwidth(args, compile_too, dev)
    for r in bw:
        for p in ("fwd", "bwd"):
            if f"{p}_TBps" in r:
                r[f"{p}_of_copy"] = r[f"{p}_TBps"] / copy_tbps
    gpt = _gpu_gpt(args, compile_too, dev)
    head = f"{name}, torch {torch.__version__}; copy bandwidth {copy_tbps:.3g} TB/s"
    tables = []
    for kind in ("rms", "layer"):
        sel = [r for r in bw if r["kind"] == kind]
        names = list(dict.fromkeys(r["impl"] for r in sel))
        for pas in ("fwd", "bwd"):
            piv = []
            for d in dict.fromkeys(r["d"] for r in sel):
                row = {"d": d, "rows": next(r["rows"] for r in sel if r["d"] == d)}
                row.update({r["impl"]: r.get(f"{pas}_TBps") for r in sel if r["d"] == d})
                piv.append(row)
            cols = [("d", "d", ""), ("rows", "rows", "")] + [(n + " TB/s", n, ".3g") for n in names]
            tables.append(table(f"add_norm ({kind}) {pas}, bf16: compulsory bytes / time ({head})", piv, cols))
    tables.append(table(f"GPT training step, bf16 autocast, fp32 residual stream ({name})", gpt, [
        ("impl", "impl", ""), ("layers", "n_layer", ""), ("n_embd", "n_embd", ""), ("batch", "batch", ""),
        ("block", "block", ""), ("median ms", "median_ms", ".2f"), ("tokens/s", "tokens_per_s", ".0f"),
        ("speedup vs naive", "speedup_vs_naive", ".3f"), ("peak MiB", "peak_MiB", ".0f"),
    ]))
    errors = [r for r in bw if "error" in r]
    if errors:
        tables.append(table("failed cells", errors, [("kind", "kind", ""), ("d", "d", ""), ("impl", "impl", ""),
                                                      ("error", "error", "")]))
    pngs = _plots(bw, out_dir, copy_tbps)
    rows = [dict(r, section="bandwidth") for r in bw] + [dict(r, section="gpt") for r in gpt]
    (out_dir / "gpu.json").write_text(json.dumps(dict(device=name, copy_TBps=copy_tbps, rows=rows), indent=1))
    (out_dir / "gpu.md").write_text("\n".join(tables) + "".join(f"\n![{Path(p).stem}]({Path(p).name})\n" for p in pngs))
    print(f"wrote {out_dir}/gpu.md, gpu.json" + "".join(f", {Path(p).name}" for p in pngs), file=sys.stderr)
    return rows, tables


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=COMMANDS)
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row instead of tables")
    ap.add_argument("--rows", type=int, nargs="+",
                    help="traffic: row counts (default 256 2048 16384; quick 256); gpu: the row count M (default 32768)")
    ap.add_argument("--d", type=int, nargs="+",
                    help="traffic: row widths (default 1024; quick 128); gpu: widths (default 1024 .. 262144)")
    ap.add_argument("--kinds", nargs="+", choices=["rms", "layer"], help="traffic: norms (default rms; quick both)")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="traffic: dtypes (default fp32 bf16)")
    ap.add_argument("--steps", type=int, help="speed: timed steps per variant (default 20; quick 3)")
    ap.add_argument("--no-compile", action="store_true", help="speed, gpu: skip the torch.compile variants")
    ap.add_argument("--out", default="out/bench", help="gpu: folder for gpu.md, gpu.json and the PNGs")
    ap.add_argument("--device", default="cuda", help="gpu: the device (cpu runs a smoke test of the code path)")
    ap.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    for name in ("rows", "d", "steps", "threads"):
        v = getattr(args, name)
        if v is not None and any(x < 1 for x in (v if isinstance(v, list) else [v])):
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, tables = {"traffic": traffic, "memory": memory, "speed": speed, "gpu": gpu}[args.what](args)
    if rows:
        emit(args, rows, tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
