"""`bench.py traffic`: bytes each op moves, Triton kernels (counted by the interpreter)
against naive eager and the compulsory minimum (`fuseblock.testing.op_traffic`); the
hyper-connection boundary (n = 4 streams, bf16) against its unfused torch form
(`fuseblock.testing.hyper_traffic`); the attention-residual boundary (S = 4 and 9 sources,
bf16) against Kimi's torch form (`fuseblock.testing.attn_res_traffic`)."""
from __future__ import annotations

import sys

import torch

from fuseblock.testing.attn_res_traffic import measure_attn_res_traffic
from fuseblock.testing.cases import OPS, RESIDUAL_OPS
from fuseblock.testing.hyper_traffic import measure_hyper_traffic
from fuseblock.testing.op_traffic import measure_residual_traffic, measure_traffic
from fuseblock.testing.quant_traffic import QUANT_OPS, measure_quant_traffic

# the mHC boundary with comb (DeepSeek-V4, GLM-5-next) and without (HY-V4), n = 4 streams
HYPER_OPS = {"hc_add_norm": True, "hc_add_norm_nocomb": False}
ATTN_RES_OPS = ["attn_res_add_norm"]  # the attention-residual boundary at S = 4 and 9


def check(args) -> str | None:
    known = OPS + RESIDUAL_OPS + list(HYPER_OPS) + ATTN_RES_OPS + QUANT_OPS
    unknown = sorted(set(args.ops or ()) - set(known))
    return f"--ops: unknown {unknown}; choose from {known}" if unknown else None


def _hyper(op: str, args) -> list[dict]:
    """The boundary at n = 4 in bf16: rows 256 (--quick 64), d = 1024 and 4096 (--quick 256)."""
    out_rows = []
    for d in [args.d] if args.d else ([256] if args.quick else [1024, 4096]):
        for rows in args.rows or ([64] if args.quick else [256]):
            out_rows += measure_hyper_traffic(rows, 4, d, torch.bfloat16, comb=HYPER_OPS[op])
            if not args.json:
                print(f"  {op} bfloat16 {rows}x4x{d} done", file=sys.stderr, flush=True)
    return out_rows


def _attn_res(args) -> list[dict]:
    """The boundary at S = 4 and 9 in bf16: rows 256 (--quick 64), d = 1024 and 4096 (--quick 256)."""
    out_rows = []
    for d in [args.d] if args.d else ([256] if args.quick else [1024, 4096]):
        for rows in args.rows or ([64] if args.quick else [256]):
            for s in (4, 9):
                out_rows += measure_attn_res_traffic(rows, s, d, torch.bfloat16)
                if not args.json:
                    print(f"  attn_res_add_norm bfloat16 {rows}x{s}x{d} done", file=sys.stderr, flush=True)
    return out_rows


def run(args) -> list[dict]:
    rows_list = args.rows or ([256, 2048] if args.quick else [256, 2048, 16384])
    d = args.d or (256 if args.quick else 1024)
    out_rows = []
    for op in args.ops or OPS + RESIDUAL_OPS + QUANT_OPS:  # the mHC boundary by name only: minutes of interpreter each
        if op in HYPER_OPS:
            out_rows += _hyper(op, args)
            continue
        if op in ATTN_RES_OPS:
            out_rows += _attn_res(args)
            continue
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
