"""Train a tiny Hugging Face model of any fused family on byte-level Shakespeare, fused
against unfused.

    python scripts/train_hf.py                     # Llama, CPU, 60 steps, well under a minute
    python scripts/train_hf.py --family gemma2 --iters 200 --layers 4 --hidden 128

Both models start from one initialization (the family's causal LM built from
fuseblock's tiny config of it, `fuseblock.integrations.transformers.tiny`, with the sizes
given here; nothing downloaded; the fused one is a copy put through
fuseblock.integrations.transformers.fuse), see the same batches and take AdamW steps
with the same settings, in training mode (a family's dropouts are on: then the two
curves agree in distribution, not step for step). The script prints both loss curves side
by side, the largest difference between them, and each model's training throughput in
tokens/s (forward, backward and optimizer step, timed apart). Exit status 2: a usage error.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bootstrap: models/ (not in the wheel)

import torch

from models import data


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {v}")
    return v


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s}")
    return v


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="llama",
                   help="the fused family to train, by config.model_type (default %(default)s; "
                        "fuseblock.integrations.transformers.SUPPORTED lists them)")
    p.add_argument("--iters", type=positive_int, default=60, help="optimizer steps (default %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step (default %(default)s)")
    p.add_argument("--block-size", type=positive_int, default=64,
                   help="tokens (bytes) per sequence (default %(default)s)")
    p.add_argument("--hidden", type=positive_int, default=64, help="hidden size (default %(default)s)")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers (default %(default)s)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (default %(default)s)")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the shared initial weights and the batches (default %(default)s)")
    p.add_argument("--eval-every", type=positive_int, default=5, help="print a row every N steps (default %(default)s)")
    args = p.parse_args(argv)
    from fuseblock.integrations.transformers import SUPPORTED

    if args.family not in SUPPORTED:
        p.error(f"--family {args.family!r} is not a fused family: {', '.join(SUPPORTED)}")
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    return args


def build(args):
    """(unfused, fused): one initialization of the family's causal LM, twice."""
    from transformers import AutoModelForCausalLM

    from fuseblock.integrations.transformers import fuse
    from fuseblock.integrations.transformers.tiny import tiny_config

    config = tiny_config(args.family, vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, head_dim=args.hidden // args.heads,
                         max_position_embeddings=args.block_size, pad_token_id=None, bos_token_id=None,
                         eos_token_id=None)
    torch.manual_seed(args.seed)
    unfused = AutoModelForCausalLM.from_config(config)
    return unfused, fuse(copy.deepcopy(unfused))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        train = data.load("train")
    except data.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(train) <= args.block_size + 1:
        print(f"error: --block-size {args.block_size} is larger than the data", file=sys.stderr)
        return 2
    unfused, fused = build(args)
    models = {"unfused": unfused, "fused": fused}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.1) for k, m in models.items()}
    gen = torch.Generator().manual_seed(args.seed)
    print(f"{args.family}: {args.layers} layers, hidden {args.hidden}, {args.heads} heads")
    print(f"{'step':>6} {'unfused':>10} {'fused':>10} {'|diff|':>10}")
    worst, seconds = 0.0, dict.fromkeys(models, 0.0)
    for step in range(1, args.iters + 1):
        starts = torch.randint(len(train) - args.block_size - 1, (args.batch_size,), generator=gen)
        x, y = data.batch(train, starts, args.block_size)
        losses = {}
        for name, model in models.items():
            start = time.perf_counter()
            # y is x shifted by one already (transformers' labels= would shift again)
            logits = model(input_ids=x, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            opts[name].step()
            losses[name] = loss.item()
            seconds[name] += time.perf_counter() - start
        diff = abs(losses["fused"] - losses["unfused"])
        worst = max(worst, diff)
        if step % args.eval_every == 0 or step == args.iters:
            print(f"{step:>6} {losses['unfused']:>10.5f} {losses['fused']:>10.5f} {diff:>10.2e}")
    params = max((a - b).abs().max().item() for a, b in zip(unfused.parameters(), fused.parameters(), strict=True))
    print(f"max |fused - unfused| loss over {args.iters} steps: {worst:.3e}; parameters after training: {params:.3e}")
    tokens = args.iters * args.batch_size * args.block_size
    print("tokens/s: " + ", ".join(f"{name} {tokens / seconds[name]:.0f}" for name in models)
          + f" (fused / unfused {seconds['unfused'] / seconds['fused']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
