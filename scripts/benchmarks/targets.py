"""`bench.py targets`: every kernel the launchers pick, compiled for every GPU target with
no GPU (`fuseblock.testing.targets`): sm_90 (H100), sm_100 (B200), gfx942 (MI300X), and
with --all also sm_120 (RTX 5090) and gfx950 (MI355X). Ops: add_norm and its variants
(layer norm, the norm alone, an fp32 residual, both gates, groups, the scaled and
dropout branch), norm_add and norm_add_norm, norm_linear's norm kernels, embed_norm and
the channel norms (batch and group norm), the scaled fp8 outputs (add_norm's fp8_tensor,
fp8_row, mxfp8 and mxfp8 down the columns too, norm_add_norm's mxfp8: forward only, the
backward is the plain op's) and the n-stream boundary (hc_add_norm with comb, n = 4, 8
and 16 streams of d), bf16 and fp32, forward and backward, d from 64 to 262144 (the
channel norms: N = 32, C = 64, d = C x L columns per sample).

One row per compiled kernel: registers per thread (VGPRs per lane on AMD), spill_bytes
per thread (local memory on NVIDIA, scratch on AMD), shared memory (LDS) per program,
programs resident per SM (CU), and the grid and its waves of resident programs at a
large row count (`rows`: 32768, or 2^29 / d elements' worth past d = 16384) once the
launch has learned what fits (waves_first: the first launch). `fills`: whether the
launch fills at least a whole wave where its work allows, the work being what it would
launch on a GPU with unbounded SMs (so a grid that is all the rows there are passes; the
backward's at most one program per 64 rows is such a bound).
A kernel compiled once per target serves every op that launches it alike (cached).
"""
from __future__ import annotations

import math
import os
import sys
import time
from types import SimpleNamespace

import torch

import fuseblock
from fuseblock.kernels import launch, occupancy
from fuseblock.testing import targets as T

QUICK_WIDTHS = [1024, 65536]
WIDTHS = [64, 256, 1024, 4096, 8192, 16384, 32768, 65536, 262144]
# The sums over partial rows (one program per column chunk, a few hundred at most) are
# not row launches: a fraction of a wave is their design, and they move ~1% of the bytes.
NOT_ROWS = {"_bwd_sum", "_bwd_sum4"}


def _ops(quick: bool) -> dict:
    """op name -> function (d, dtype, rows, compiled) -> the launches of its forward and backward."""

    def add_norm(kind="rms", residual=True, gate=None, res32=False, **kw):
        def build(d, dtype, rows, compiled):
            x, w = torch.empty(rows, d, dtype=dtype), torch.empty(d, dtype=dtype)
            r = torch.empty(rows, d, dtype=torch.float32 if res32 else dtype) if residual else None
            z = torch.empty_like(x) if gate else None
            x1 = torch.empty_like(x) if "dropout_p" in kw else None
            return T.norm_launches(x, r, w, w if kind == "layer" else None, z, kind=kind, x1=x1, compiled=compiled,
                                   gate_position=gate or "post", **kw)
        return build

    def norm_add(kind, second):
        def build(d, dtype, rows, compiled):
            x, w = torch.empty(rows, d, dtype=dtype), torch.empty(d, dtype=dtype)
            return T.norm_add_launches(x, torch.empty_like(x), w, w, kind=kind, second=second, compiled=compiled)
        return build

    def norm_linear(d, dtype, rows, compiled):
        x, w = torch.empty(rows, d, dtype=dtype), torch.empty(d, dtype=dtype)
        return T.norm_linear_launches(x, torch.empty_like(x), w, compiled=compiled)

    def embed_norm(d, dtype, rows, compiled):
        return T.embed_norm_launches(torch.empty(rows, d, dtype=dtype), compiled=compiled)

    def channel(batch):
        def build(d, dtype, rows, compiled):
            x, w = torch.empty(32, 64, max(1, d // 64), dtype=dtype), torch.empty(64, dtype=dtype)
            return T.channel_norm_launches(x, w, w, batch=batch, groups=0 if batch else 8, compiled=compiled)
        return build

    def quant(mode, columnwise=False, second=False):
        def build(d, dtype, rows, compiled):
            x, w = torch.empty(rows, d, dtype=dtype), torch.empty(d, dtype=dtype)
            recipe = fuseblock.Fp8Recipe(mode, mx_columnwise=columnwise)
            return T.quant_launches(x, torch.empty_like(x), w, quant=recipe, second=second, compiled=compiled)
        return build

    def hyper(n):
        def build(d, dtype, rows, compiled):  # at most 2^27 stream elements: the tensors are allocated, unused
            return T.hyper_launches(max(16, min(rows, (1 << 27) // (n * d))), n, d, dtype, compiled=compiled)
        return build

    if quick:
        return {"add_norm_layer": add_norm("layer"), "norm_add_norm": norm_add("rms", True)}
    return {
        "add_norm": add_norm(), "add_norm_layer": add_norm("layer"), "norm": add_norm(residual=False),
        "add_norm_fp32_residual": add_norm("layer", res32=True, residual_dtype=torch.float32),
        "pre_gate": add_norm("layer", gate="pre", gate_act="sigmoid"), "post_gate": add_norm(gate="post"),
        "groups": add_norm("layer", num_groups=4), "add_norm_dropout": add_norm("layer", alpha=0.5, dropout_p=0.1),
        "norm_add": norm_add("rms", False), "norm_add_layer": norm_add("layer", False),
        "norm_add_norm": norm_add("rms", True), "norm_add_norm_layer": norm_add("layer", True),
        "norm_linear": norm_linear, "embed_norm": embed_norm,
        "batch_norm": channel(True), "group_norm": channel(False),
        "fp8_tensor": quant("fp8_tensor"), "fp8_row": quant("fp8_row"), "mxfp8": quant("mxfp8"),
        "mxfp8_columnwise": quant("mxfp8", columnwise=True), "norm_add_norm_mxfp8": quant("mxfp8", second=True),
        "hc_n4": hyper(4), "hc_n8": hyper(8), "hc_n16": hyper(16),
    }


def _key(target: str, ln) -> tuple:
    sig, constexprs, attrs, options = T.launch_signature(ln)
    return (target, ln.fn.fn.__module__, ln.name, tuple(sig.items()), repr(sorted(constexprs.items())),
            repr(sorted(attrs.items())), repr(sorted(options.items())))


class _Compiler:
    """Compiles each distinct kernel once per target and remembers its usage."""

    def __init__(self):
        self.cache: dict[tuple, dict] = {}

    def usage(self, target: str, ln) -> dict:
        key = _key(target, ln)
        if key not in self.cache:
            t0 = time.perf_counter()
            kernel = T.compile_for(ln, target)
            self.cache[key] = dict(T.resource_usage(kernel), compile_s=time.perf_counter() - t0)
        return self.cache[key]


def _grid(ln) -> int:
    return math.prod(ln.grid)


def _rows(target: str, op: str, build, d: int, dtype, rows: int, comp: _Compiler) -> list[dict]:
    t = T.TARGETS[target]

    def compiled(ln):  # as a GPU launch returns its compiled kernel, registers known
        u = comp.usage(target, ln)
        return SimpleNamespace(n_regs=u["registers"], metadata=SimpleNamespace(shared=u["shared"]))

    with T.for_target(target):
        occupancy.forget()  # the first launch of each variant, as a fresh process makes it
        first = build(d, dtype, rows, compiled)
        learned = build(d, dtype, rows, None)
        occupancy.forget()
        launch.H100_SMS = 1 << 20  # the work: what the launch takes when SMs are not the bound
        work = build(d, dtype, rows, None)
    out = []
    for ln, ln_l, ln_w in zip(first, learned, work, strict=True):
        u = comp.usage(target, ln)
        warps = ln.kwargs.get("num_warps", 4)
        per_sm = occupancy.resident_programs(u, warps, t.sm)
        slots = t.sms * per_sm
        block = "x".join(str(ln.kwargs[k]) for k in ("BR", "BG", "BD", "BL") if k in ln.kwargs)
        grid = _grid(ln_l)
        fills = ln.name in NOT_ROWS or grid >= min(slots, _grid(ln_w))
        out.append(dict(
            target=target, gpu=t.gpu, op=op, kernel=ln.name, d=d, dtype=str(dtype).removeprefix("torch."),
            block=block, num_warps=warps, registers=u["registers"], spill_bytes=u["stack"], shared=u["shared"],
            resident_per_sm=per_sm, rows=rows, grid=grid, waves=grid / max(slots, 1),
            waves_first=_grid(ln) / max(slots, 1), fills=fills, compile_s=u["compile_s"],
        ))
    return out


def sweep(targets, ops: dict, widths, dtypes, progress=None) -> list[dict]:
    comp = _Compiler()
    rows_out = []
    for target in targets:
        for d in widths:
            rows = 32768 if d <= 16384 else (1 << 29) // d
            for dtype in dtypes:
                for op, build in ops.items():
                    rows_out += _rows(target, op, build, d, dtype, rows, comp)
            if progress:
                progress(f"  {target} d={d} done ({len(comp.cache)} kernels compiled)")
    return rows_out


def check(args) -> str | None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "targets needs triton's compiler: unset TRITON_INTERPRET"
    unknown = [op for op in args.ops or [] if op not in _ops(False)]
    return f"--ops: unknown {unknown}; choose from {list(_ops(False))}" if unknown else None


def run(args) -> list[dict]:
    names = list(T.TARGETS) if args.all else list(T.MAIN_TARGETS)
    if args.quick:
        names = ["sm_90", "gfx942"]
    targets = []
    for name in names:
        problem = T.backend_problem(name)
        if problem:
            print(f"skipped {name}: {problem}", file=sys.stderr)
        else:
            targets.append(name)
    widths = [args.d] if args.d else QUICK_WIDTHS if args.quick else WIDTHS
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float32]
    t0 = time.perf_counter()
    ops = {k: v for k, v in _ops(args.quick).items() if args.ops is None or k in args.ops}
    out = sweep(targets, ops, widths, dtypes,
                progress=None if args.json else lambda m: print(m, file=sys.stderr, flush=True))
    if not args.json:
        spills = [r for r in out if r["spill_bytes"]]
        empty = [r for r in out if not r["fills"]]
        print(f"{len(out)} launches, {len({(r['target'], r['kernel'], r['block'], r['registers']) for r in out})} "
              f"distinct; spilling: {len(spills)}; short of a wave: {len(empty)}; "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out
