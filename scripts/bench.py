"""Benchmarks, each printing a markdown table (--json: one JSON row per line).

    python scripts/bench.py traffic [--quick]   bytes moved: Triton kernels (interpreter) vs naive eager vs minimum
    python scripts/bench.py memory  [--quick]   bytes saved for backward per layer per token, fused vs naive GPT
    python scripts/bench.py speed   [--quick]   CPU training-step time: naive, fused, and torch.compile of each
    python scripts/bench.py gpu     [--out DIR] GPU bandwidth and GPT step time (exits 0 without CUDA)

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

ACTIVATION_ARGS = {"X", "R", "Y", "O", "RO", "P", "DO", "DRO", "DX", "DR", "DY"}
OPS = ["norm", "add_norm", "add_norm_layer", "add_norm_fp32_residual", "pre_gate", "post_gate", "post_gate_residual"]


def emit(rows: list[dict], as_json: bool) -> None:
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    print()


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


def _naive(op, x, residual, w, kw):
    """The same function as eager torch: x + residual, then torch's own norm (and gate)."""
    p = x if residual is None else (x.to(residual.dtype) + residual if "residual_dtype" in kw else x + residual)
    g = F.silu(kw["gate"]) if "gate" in kw else None
    s = p * g if kw.get("gate_position") == "pre" else p
    if kw.get("kind") == "layer":
        out = F.layer_norm(s, (s.shape[-1],), w.to(s.dtype), kw["bias"].to(s.dtype), 1e-6)
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
    min_f, min_b = _minimum(x, residual, kw, out, new_res)

    def act(kt):
        return sum(v for ln in kt.launches for part in (ln.read, ln.written) for k, v in part.items() if k in ACTIVATION_ARGS)

    parts = {"fwd": ([kf], [nf], min_f), "bwd": ([kb], [nb], min_b), "fwd+bwd": ([kf, kb], [nf, nb], min_f + min_b)}
    out_rows = []
    for pas, (kts, nts, mn) in parts.items():
        a = sum(map(act, kts))
        kernel = sum(k.bytes + k.glue_bytes for k in kts)
        naive = sum(n.bytes for n in nts)
        out_rows.append(dict(
            op=op, dtype=str(dtype).removeprefix("torch."), rows=rows, d=d, pas=pas,
            kernel_MB=kernel / 1e6, naive_MB=naive / 1e6, min_MB=mn / 1e6, other_MB=(kernel - a) / 1e6,
            kernel_over_min=kernel / mn, act_over_min=a / mn, naive_over_kernel=naive / kernel,
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
def _gpt(fused: bool, quick: bool, norm: str = "rms"):
    from models.gpt import GPT, GPTConfig

    cfg = GPTConfig(block_size=64, n_layer=2 if quick else 4, n_head=4, n_embd=64 if quick else 128, norm=norm, fused=fused)
    torch.manual_seed(0)
    return GPT(cfg)


def memory(args) -> list[dict]:
    rows = []
    B, T = 4, 64
    for norm in ("rms", "layer"):
        res = {}
        for fused in (False, True):
            model = _gpt(fused, args.quick, norm)
            idx = torch.randint(0, 256, (B, T))
            seen: dict[int, int] = {}

            def pack(t):
                if t.device.type != "meta":
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                _, loss = model(idx, idx)
            res[fused] = sum(seen.values())
            del loss
        layers = model.config.n_layer
        for fused in (False, True):
            rows.append(dict(norm=norm, impl="fused" if fused else "naive", saved_MB=res[fused] / 1e6,
                             bytes_per_layer_per_token=res[fused] / (layers * B * T)))
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
    times = {k: [] for k in impls}
    for k, (m, opt) in impls.items():  # warm up (and compile)
        m(idx, idx)[1].backward()
        opt.zero_grad()
    for _ in range(steps):  # alternate, so drift hits every variant alike
        for k, (m, opt) in impls.items():
            t0 = time.perf_counter()
            m(idx, idx)[1].backward()
            opt.step()
            opt.zero_grad()
            times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["naive"])
    return [dict(impl=k, median_ms=statistics.median(v) * 1e3, tokens_per_s=B * 64 / statistics.median(v),
                 speedup_vs_naive=base / statistics.median(v)) for k, v in times.items()]


# ------------------------------------------------------------------------------ gpu
def gpu(args) -> list[dict]:
    if not torch.cuda.is_available():
        print("no CUDA device: the gpu benchmark needs one (nothing to do)")
        return []
    import torch._functorch.config as fconfig
    from triton.testing import do_bench

    fconfig.donated_buffer = False  # the naive compiled backward is re-run with retain_graph
    dt = torch.bfloat16
    rows = []

    def naive(x, r, w, kind):
        p = x + r
        out = F.rms_norm(p, (p.shape[-1],), w, 1e-6) if kind == "rms" else F.layer_norm(p, (p.shape[-1],), w, None, 1e-6)
        return out, p

    compiled = torch.compile(naive)
    ds = [1024, 4096, 16384, 65536, 262144] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
    for kind in ("rms", "layer"):
        for d in ds:
            M = min(32768, (1 << 29) // d)
            x = torch.randn(M, d, device="cuda", dtype=dt, requires_grad=True)
            r = torch.randn(M, d, device="cuda", dtype=dt, requires_grad=True)
            w = torch.ones(d, device="cuda", dtype=dt, requires_grad=True)
            nbytes = 4 * M * d * 2  # fwd: x, r in; out, p out. bwd: p, dout, dp in; dx out
            impls = {"fuseblock": lambda: fuseblock.add_norm(x, r, w, kind=kind),
                     "eager": lambda: naive(x, r, w, kind), "compile": lambda: compiled(x, r, w, kind)}
            row = dict(kind=kind, d=d, rows=M)
            for name, fn in impls.items():
                try:
                    with torch.no_grad():
                        tf = do_bench(fn, warmup=5, rep=25)
                    out, p = fn()
                    go, gp = torch.randn_like(out), torch.randn_like(p)
                    tb = do_bench(lambda: torch.autograd.grad((out, p), (x, r, w), (go, gp), retain_graph=True), warmup=5, rep=25)
                    row[f"{name}_fwd_TBps"] = nbytes / tf / 1e9
                    row[f"{name}_bwd_TBps"] = nbytes / tb / 1e9
                except Exception as e:  # report, keep going
                    row[f"{name}_error"] = type(e).__name__
            rows.append(row)
            del x, r, w
            torch.cuda.empty_cache()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu.json").write_text(json.dumps(rows, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        for kind in ("rms", "layer"):
            fig, axes = plt.subplots(1, 2, figsize=(10, 4))
            sel = [r for r in rows if r["kind"] == kind]
            for ax, pas in zip(axes, ("fwd", "bwd")):
                for name in ("fuseblock", "eager", "compile"):
                    pts = [(r["d"], r[f"{name}_{pas}_TBps"]) for r in sel if f"{name}_{pas}_TBps" in r]
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=name)
                ax.set_xscale("log", base=2)
                ax.set_title(f"add_norm {kind} {pas}, bf16")
                ax.set_xlabel("d")
                ax.set_ylabel("TB/s (compulsory bytes / time)")
                ax.legend()
                ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(out_dir / f"gpu_{kind}.png")
            plt.close(fig)
    except ImportError:
        pass
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["traffic", "memory", "speed", "gpu"])
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument("--out", default="out/bench", help="gpu: where the table and plots go")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ops", type=lambda v: v.split(","), default=None, help=f"traffic: a comma list of {OPS}")
    ap.add_argument("--rows", type=lambda v: [int(r) for r in v.split(",")], default=None, help="traffic: row counts")
    ap.add_argument("--d", type=int, default=None, help="traffic: row width")
    args = ap.parse_args(argv)
    if args.ops and set(args.ops) - set(OPS):
        ap.error(f"--ops: unknown {sorted(set(args.ops) - set(OPS))}; choose from {OPS}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = {"traffic": traffic, "memory": memory, "speed": speed, "gpu": gpu}[args.what](args)
    if rows:
        emit(rows, args.json)


if __name__ == "__main__":
    main()
