"""The forward tile kernel against the row-looping one at one row width, on a GPU: how
`fuseblock.kernels.launch.MAX_TILE_FWD_HEAVY` was chosen (docs/performance.md, "The forward
tile at d = 32768"). Each add_norm variant runs with MAX_TILE_FWD at d (the tile) and at
d / 2 (the loop), in one process on the same inputs, with both heavy-variant limits lifted
so the width alone decides; median, min and max of --repeats runs of triton's do_bench.

    python tools/tile_vs_loop.py [--d 32768] [--rows 2048] [--dtype bf16|fp32] [--repeats 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


def cases(x, r, g, w, b):
    import fuseblock

    an = fuseblock.add_norm
    return {
        "rms": lambda: an(x, r, w),
        "layer": lambda: an(x, r, w, b, kind="layer"),
        "pre_gate": lambda: an(x, r, w, gate=g, gate_position="pre"),
        "post_gate": lambda: an(x, r, w, gate=g),
        "dropout": lambda: an(x, r, w, dropout_p=0.1),
        "fp32_residual": lambda: an(x, r, w, residual_dtype=torch.float32),
        "fp8_row": lambda: an(x, r, w, quant="fp8_row"),
        "mxfp8": lambda: an(x, r, w, quant="mxfp8"),
        "groups8": lambda: an(x, r, w, num_groups=8),
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=32768)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="the activations' and weights' dtype")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this times GPU kernels (nothing to do)")
        return []
    from triton.testing import do_bench

    import fuseblock.kernels.launch as L

    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x, r, g = (torch.randn(args.rows, args.d, device="cuda", dtype=dtype) for _ in range(3))
    w, b = (torch.randn(args.d, device="cuda", dtype=dtype) for _ in range(2))
    saved = L.MAX_TILE_FWD, L.MAX_TILE_FWD_HEAVY
    rows = []
    try:
        for name, fn in cases(x, r, g, w, b).items():
            row = dict(variant=name, dtype=args.dtype, d=args.d, rows=args.rows)
            for label, tile in (("tile", args.d), ("loop", args.d // 2)):
                L.MAX_TILE_FWD = L.MAX_TILE_FWD_HEAVY = tile
                with torch.no_grad():
                    ts = [do_bench(fn, warmup=10, rep=40) for _ in range(args.repeats)]
                row |= {f"{label}_ms": statistics.median(ts), f"{label}_min": min(ts), f"{label}_max": max(ts)}
            row["loop_over_tile"] = row["loop_ms"] / row["tile_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        L.MAX_TILE_FWD, L.MAX_TILE_FWD_HEAVY = saved
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
