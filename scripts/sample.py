"""Sample text from a trained checkpoint.

    python scripts/sample.py --ckpt out/shakespeare --prompt "ROMEO:" --max-new-tokens 300

--ckpt is an output directory (its `latest` checkpoint) or one checkpoint directory.
A missing, truncated, corrupt, mismatched or diverged (NaN) checkpoint is a one-line
error and exit 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bootstrap: models/ (not in the wheel)

import torch

from models import checkpoint
from models.gpt import GPT


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Sample from a fuseblock GPT checkpoint.")
    ap.add_argument("--ckpt", type=Path, required=True,
                    help="a training --out-dir (its `latest` checkpoint) or one checkpoint directory (required)")
    ap.add_argument("--prompt", default="\n", help="text the sample continues, UTF-8 bytes (default: a newline)")
    ap.add_argument("--max-new-tokens", type=int, default=500, help="bytes to generate (default: 500)")
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="softmax temperature, 0 for greedy decoding (default: 0.8)")
    ap.add_argument("--top-k", type=int, default=None,
                    help="sample among the k likeliest bytes only (default: none, all 256)")
    ap.add_argument("--seed", type=int, default=1337, help="seeds the sampling generator (default: 1337)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        ap.error(f"argument --device: unknown device {args.device!r}")
    if dev.type not in ("cpu", "cuda") or (
        dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count())
    ):
        ap.error(f"argument --device: {args.device} is not available on this machine")
    if args.max_new_tokens < 0:
        ap.error(f"argument --max-new-tokens: must be >= 0, got {args.max_new_tokens}")
    if not 0 <= args.temperature < float("inf"):
        ap.error(f"argument --temperature: must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        ap.error(f"argument --top-k: must be >= 1, got {args.top_k}")
    if args.threads is not None and args.threads < 1:
        ap.error(f"argument --threads: must be >= 1, got {args.threads}")
    if not args.prompt:
        ap.error("argument --prompt: must not be empty")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = checkpoint.resolve(args.ckpt)
    meta = checkpoint.read_meta(ckpt)
    model = GPT(checkpoint.read_config(ckpt, meta))
    checkpoint.load_weights(ckpt, model)
    model.to(args.device).eval()
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    idx = torch.tensor([list(args.prompt.encode("utf-8"))], dtype=torch.long, device=args.device)
    out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, generator=gen)
    sys.stdout.write(bytes(out[0].tolist()).decode("utf-8", errors="replace") + "\n")


def cli(argv=None) -> None:
    """The command line: a bad checkpoint is a one-line error with exit status 2."""
    try:
        main(argv)
    except checkpoint.CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
