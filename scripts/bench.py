"""Benchmarks, each printing a markdown table (--json: one JSON row per line).

    python scripts/bench.py traffic [--quick]   bytes moved: Triton kernels (interpreter) vs naive eager vs minimum;
                                                slow: every op at 256, 2048 and 16384 rows took about 23 minutes
                                                on a 2-core CPU; --quick (256 and 2048 rows, d = 256) takes 44 s
                                                of CPU time (5.5 minutes wall at load average 8); --ops, --rows
                                                and --d pick a part; --ops hc_add_norm: the mHC boundary (n = 4
                                                streams, bf16, 256 tokens at d = 1024 and 4096; not in the default);
                                                --ops attn_res_add_norm: the attention residual (S = 4 and 9, the same)
    python scripts/bench.py stream  [--quick]   hidden-stream bytes of one decoder layer per stream shape (pre-norm,
                                                scaled, parallel, dropout, post-norm, sandwich), untouched torch ops
                                                vs fused, fwd and bwd; --rows, --d, --dtype pick the size
    python scripts/bench.py memory  [--quick]   bytes saved for backward per layer per token, fused vs naive GPT
    python scripts/bench.py speed   [--quick] [--repeats N]  CPU training-step time: naive, fused, torch.compile of each
    python scripts/bench.py gpu     [--out DIR] GPU add_norm bandwidth vs eager and torch.compile (exits 0 without CUDA)
    python scripts/bench.py gpt-step [--quick] [--repeats N] [--model gpt2|llama|both]  GPT-2-small and Llama-shaped
                                                training steps on a GPU: fused, naive, compiled, reduce-overhead
    python scripts/bench.py gpu-report [--out DIR]  the report of `make gpu-check`, from the parts' outputs in DIR
    python scripts/bench.py sm90    [--quick]   each kernel compiled for an H100 without one: registers, spills
    python scripts/bench.py targets [--quick] [--all]  every kernel compiled for sm_90, sm_100, gfx942 (--all: also
                                                sm_120, gfx950) without a GPU: registers, spills, LDS, occupancy, waves
    python scripts/bench.py fuse-blocks [--quick] [--repeats N]  training step of the four host models (nanoGPT,
                                                timm ViT, litgpt, torchtitan) as written and after fuse_blocks (CPU)
    python scripts/bench.py overhead [--quick]  host-side (Python) time per call, kernels not run; --ops a,b: only
                                                those ops' rows (fwd and fwd+bwd us and calls per call), --device
                                                cuda: with the real launches

Options go before or after the subcommand. Each subcommand is a module of
scripts/benchmarks/; the byte model of `traffic` is in fuseblock/testing/op_traffic.py.
A table is followed by what its columns mean where that is not plain (speed, gpt-step).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the bootstrap: fuseblock and models/ (not in the wheel) from this checkout

from benchmarks import cli  # noqa: E402  (imports neither torch nor fuseblock)


def main(argv=None) -> None:
    ap = cli.parser(__doc__)
    args = ap.parse_args(argv)
    problem = cli.check(args)
    if problem:
        ap.error(problem)
    # Decided here, from the parsed subcommand, because triton reads TRITON_INTERPRET when
    # first imported and fuseblock's dispatch reads it when fuseblock is: nothing above
    # has imported either.
    if args.what in cli.INTERPRETED:
        os.environ["TRITON_INTERPRET"] = "1"
        from fuseblock.testing import interpreter_lang

        interpreter_lang.install()  # the interpreter patches its language once a launch (it counts the same bytes)
    import torch
    from benchmarks.common import emit

    module = importlib.import_module(f"benchmarks.{args.what.replace('-', '_')}")
    problem = module.check(args) if hasattr(module, "check") else None
    if problem:
        ap.error(problem)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = module.run(args)
    if rows:
        emit(rows, args.json, getattr(module, "COLUMNS", None))


if __name__ == "__main__":
    main()
