"""`bench.py sm90`: compile every kernel the launchers pick for bf16 add_norm (rms; layer
with bias) for an H100 (sm_90) with Triton's compiler and ptxas: no GPU needed. Reports
what the cubin uses per thread (registers; stack, where spilled registers go, through L1
and L2), the programs an SM holds at once, and the grid in waves of those, on the first
launch (default programs per SM) and once the launch has learned what fits
(`fuseblock.kernels.occupancy`): a persistent kernel wants at most 1."""
from __future__ import annotations

import math
import os
import sys
import time
from types import SimpleNamespace

import torch

from fuseblock.kernels import occupancy
from fuseblock.kernels.launch import H100_SMS
from fuseblock.testing.targets import compile_for, norm_launches, resource_usage


def _widths(args) -> list[int]:
    if args.d:
        return [args.d]
    return [1024, 65536] if args.quick else [256, 1024, 4096, 16384, 32768, 65536, 262144]


def _kind_rows(kind: str, d: int, rows: int) -> list[dict]:
    """One row per kernel of one add_norm forward and backward at (rows, d)."""
    x = torch.empty(rows, d, dtype=torch.bfloat16)
    w = torch.empty(d, dtype=torch.bfloat16)
    usage = {}

    def compiled(ln):  # as a GPU launch returns its compiled kernel, registers known
        t0 = time.perf_counter()
        kernel = compile_for(ln)
        usage[ln.name] = dict(resource_usage(kernel), compile_s=time.perf_counter() - t0)
        return SimpleNamespace(n_regs=usage[ln.name]["registers"], metadata=kernel.metadata)

    inputs = (x, torch.empty_like(x), w, w if kind == "layer" else None)
    occupancy.forget()  # the first launch of each variant, as a fresh process makes it
    first = norm_launches(*inputs, kind=kind, compiled=compiled)
    learned = {ln.name: ln for ln in norm_launches(*inputs, kind=kind)}
    out = []
    for ln in first:
        u = usage[ln.name]
        warps = ln.kwargs.get("num_warps", 4)
        slots = H100_SMS * occupancy.resident_programs(u, warps)
        block = "x".join(str(ln.kwargs[k]) for k in ("BR", "BG", "BD") if k in ln.kwargs)
        out.append(dict(
            kind=kind, d=d, rows=rows, kernel=ln.name, block=block, num_warps=warps,
            registers=u["registers"], stack=u["stack"], shared=u["shared"], resident_per_sm=slots // H100_SMS,
            grid_first="x".join(map(str, ln.grid)), waves_first=math.prod(ln.grid) / slots,
            grid="x".join(map(str, learned[ln.name].grid)), waves=math.prod(learned[ln.name].grid) / slots,
            compile_s=u["compile_s"],
        ))
    return out


def run(args) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sm90 needs triton's compiler: unset TRITON_INTERPRET")
    out_rows = []
    for d in _widths(args):
        rows = min(32768, (1 << 29) // d)  # as `gpu` does: the grids are the benchmark's
        for kind in ("rms", "layer"):
            out_rows += _kind_rows(kind, d, rows)
            if not args.json:
                print(f"  {kind} d={d} done", file=sys.stderr, flush=True)
    return out_rows
