"""`bench.py traffic`: bytes each op moves, Triton kernels (counted by the interpreter)
against naive eager and the compulsory minimum (`fuseblock.testing.op_traffic`)."""
from __future__ import annotations

import sys

import torch

from fuseblock.testing.cases import OPS, RESIDUAL_OPS
from fuseblock.testing.op_traffic import measure_residual_traffic, measure_traffic
from fuseblock.testing.quant_traffic import QUANT_OPS, measure_quant_traffic


def check(args) -> str | None:
    unknown = sorted(set(args.ops or ()) - set(OPS) - set(RESIDUAL_OPS) - set(QUANT_OPS))
    return f"--ops: unknown {unknown}; choose from {OPS + RESIDUAL_OPS + QUANT_OPS}" if unknown else None


def run(args) -> list[dict]:
    rows_list = args.rows or ([256, 2048] if args.quick else [256, 2048, 16384])
    d = args.d or (256 if args.quick else 1024)
    out_rows = []
    for op in args.ops or OPS + RESIDUAL_OPS + QUANT_OPS:
        measure = measure_residual_traffic if op in RESIDUAL_OPS else measure_traffic  # unfused against fused
        if op in QUANT_OPS:  # forward only: the fp8 codes carry no gradient
            measure = measure_quant_traffic
        for dtype in (torch.float32, torch.bfloat16):
            if op == "add_norm_fp32_residual" and dtype == torch.float32:
                continue  # the same op as add_norm
            for rows in rows_list:
                out_rows += measure(op, rows, d, dtype)
                if not args.json:
                    print(f"  {op} {dtype} {rows}x{d} done", file=sys.stderr, flush=True)
    return out_rows
