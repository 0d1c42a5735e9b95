"""`bench.py stream`: the hidden-stream bytes of one decoder layer per stream shape, the
untouched torch ops against fuseblock's fused calls, forward and backward
(`fuseblock.testing.stream_traffic`; the fused side counted by the Triton interpreter)."""
from __future__ import annotations

import sys

import torch

from fuseblock.testing.stream_traffic import STREAM_SHAPES, measure_stream_traffic

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}

COLUMNS = {
    "shape": "the stream shape (docs/stream.md): how a sublayer's branch joins the stream (mhc: n = 4 "
             "hyper-connection streams, each boundary one hc_add_norm)",
    "pas": "fwd, bwd, or both: one layer's residual adds and norms, its mixers cut out",
    "untouched_MB": "bytes the torch ops a model writes move, each op one kernel (torch's rms_norm and dropout "
                    "as CUDA runs them)",
    "fused_MB": "bytes fuseblock's calls move (add_norm, norm_add, norm_add_norm): the kernels' distinct bytes "
                "plus any torch op between them",
    "untouched_hiddens": "untouched_MB in units of one hidden state (rows x d x dtype size)",
    "fused_hiddens": "fused_MB in the same units",
    "untouched_ops": "the torch ops of the untouched form (the add that sums two gradients of one tensor included)",
    "fused_launches": "the Triton launches of the fused form, plus its torch ops (the dropout seed, a gradient sum)",
}


def check(args) -> str | None:
    unknown = sorted(set(args.dtype or ()) - set(DTYPES))
    return f"--dtype: unknown {unknown}; choose from {sorted(DTYPES)}" if unknown else None


def run(args) -> list[dict]:
    rows_list = args.rows or ([128] if args.quick else [1024])
    d = args.d or (256 if args.quick else 1024)
    dtypes = args.dtype or (["bf16"] if args.quick else ["bf16", "fp32"])
    out_rows = []
    for dtype in dtypes:
        for rows in rows_list:
            for shape in STREAM_SHAPES:
                out_rows += measure_stream_traffic(shape, rows, d, DTYPES[dtype])
                if not args.json:
                    print(f"  {shape} {dtype} {rows}x{d} done", file=sys.stderr, flush=True)
    return out_rows
