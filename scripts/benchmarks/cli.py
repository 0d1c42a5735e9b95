"""bench.py's command line. Imports neither torch nor fuseblock: the subcommand decides
whether triton runs its interpreter, and triton reads TRITON_INTERPRET when first imported."""
from __future__ import annotations

import argparse

SUBCOMMANDS = ["traffic", "memory", "speed", "gpu", "gpt-step", "sm90", "targets", "overhead", "gpu-report", "stream",
               "fuse-blocks"]
# Subcommands that count bytes through the Triton interpreter: on a machine with no GPU
# it is the only way to run the kernels at all.
INTERPRETED = {"traffic", "stream"}


def _ints(value: str) -> list[int]:
    return [int(r) for r in value.split(",")]


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """One flat parser: argparse takes the options before or after the subcommand alike."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=SUBCOMMANDS)
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument("--out", default="out/bench",
                    help="gpu: where the table and plots go; gpu-report: the folder make gpu-check fills")
    ap.add_argument("--device", default="cuda",
                    help="gpu, gpt-step: the device; cpu runs a toy-size smoke test of the code; overhead: cuda "
                         "times the per-op rows' real launches (cpu, or no GPU: launches recorded, not run)")
    ap.add_argument("--model", choices=["gpt2", "llama", "both"], default="both",
                    help="gpt-step: GPT-2 small, the Llama-shaped model, or both one after the other (default)")
    ap.add_argument("--no-compile", action="store_true", help="gpu: skip the torch.compile baseline")
    ap.add_argument("--all", action="store_true", help="targets: also sm_120 and gfx950")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3,
                    help="speed, gpt-step: independent runs of all the steps (median, min, max; default 3)")
    ap.add_argument("--ops", type=lambda v: v.split(","), default=None,
                    help="traffic: a comma list of ops (fuseblock.testing.cases.OPS, RESIDUAL_OPS, and hc_add_norm, "
                         "hc_add_norm_nocomb: the mHC boundary at n = 4, attn_res_add_norm: the attention residual "
                         "at S = 4 and 9; default all but these three); overhead: "
                         "only the per-op rows of these (add_norm, add_norm_layer, norm, norm_add); targets: "
                         "only these of its ops (e.g. hc_n4,hc_n8,hc_n16)")
    ap.add_argument("--rows", type=_ints, default=None,
                    help="traffic: row counts (default 256,2048,16384; --quick 256,2048); gpu: the first is the "
                         "row count (default 32768), capped at 2^29 / d; stream: row counts (default 1024; "
                         "--quick 128)")
    ap.add_argument("--d", type=int, default=None,
                    help="traffic: row width (default 1024; --quick 256); sm90, targets, gpu: this one row width "
                         "instead of their list; stream: the hidden size (default 1024; --quick 256)")
    ap.add_argument("--dtype", type=lambda v: v.split(","), default=None,
                    help="stream: a comma list of bf16, fp16, fp32 (default bf16,fp32; --quick bf16)")
    return ap


def check(args) -> str | None:
    """What is wrong with the arguments as far as can be told without importing torch, or None."""
    if args.repeats < 1:
        return f"--repeats must be >= 1, got {args.repeats}"
    return None
