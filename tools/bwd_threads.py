"""The norm's tile backward at narrow rows, compiled for a GPU this machine need not have:
registers a thread and programs (warps) an SM with its programs capped at 512 threads (the
default, `fuseblock.kernels.launch.BWD_MAX_THREADS`) and at 256 (docs/performance.md, the
narrow-row backward). Needs triton's compiler, not a GPU.

    python tools/bwd_threads.py [--target sm_90] [--dtype bf16|fp32]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = ap.parse_args(argv)
    from fuseblock.kernels import launch, occupancy
    from fuseblock.testing import targets as T

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t = T.TARGETS[args.target]
    print("| kind | d | max threads | BR | warps | registers | stack | programs an SM | warps an SM |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in ("rms", "layer"):
        for d in (1024, 2048, 4096):
            for cap in (512, 256):
                launch.BWD_MAX_THREADS = cap
                x, w = torch.empty(32768, d, dtype=dtype), torch.empty(d, dtype=dtype)
                with T.for_target(args.target):
                    got = T.norm_launches(x, torch.empty_like(x), w, w if kind == "layer" else None, None, kind=kind)
                ln = next(ln for ln in got if ln.name == "_bwd_tile")
                use = T.resource_usage(T.compile_for(ln, args.target))
                nw = ln.kwargs["num_warps"]
                n = occupancy.resident_programs(use, nw, t.sm)
                print(f"| {kind} | {d} | {cap} | {ln.kwargs['BR']} | {nw} | {use['registers']} | {use['stack']} | {n} "
                      f"| {n * nw} |")


if __name__ == "__main__":
    main()
