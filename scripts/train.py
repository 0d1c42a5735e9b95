"""Train the small GPT on byte-level Shakespeare: CPU, one GPU, or DDP via torchrun.

    python scripts/train.py --out-dir out/shakespeare            # the `make train` run
    python scripts/train.py --out-dir out/shakespeare --resume   # continue from `latest`
    torchrun --standalone --nproc_per_node=2 scripts/train.py ... # DDP (gloo on CPU, nccl on GPU)

Every rank draws the same global batch of world_size * grad_accum micro-batches from one
seeded generator and takes its own slice, so N processes match one process with N times
the gradient accumulation.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from models import checkpoint, data  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402

MODEL_FLAGS = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64}


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s}")
    return v


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train the fuseblock GPT on Shakespeare.")
    ap.add_argument("--out-dir", type=Path, default=Path("out/shakespeare"))
    ap.add_argument("--max-iters", type=positive_int, default=1200)
    ap.add_argument("--impl", choices=["fused", "naive"], default="fused")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    ap.add_argument("--n-layer", type=positive_int, default=None, help=f"default {MODEL_FLAGS['n_layer']}")
    ap.add_argument("--n-head", type=positive_int, default=None, help=f"default {MODEL_FLAGS['n_head']}")
    ap.add_argument("--n-embd", type=positive_int, default=None, help=f"default {MODEL_FLAGS['n_embd']}")
    ap.add_argument("--block-size", type=positive_int, default=None, help=f"default {MODEL_FLAGS['block_size']}")
    ap.add_argument("--norm", choices=["rms", "layer"], default="rms")
    ap.add_argument("--batch-size", type=positive_int, default=32)
    ap.add_argument("--grad-accum", type=positive_int, default=1)
    ap.add_argument("--lr", type=positive_float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=2e-4)
    ap.add_argument("--warmup-iters", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    ap.add_argument("--eval-interval", type=positive_int, default=300)
    ap.add_argument("--eval-iters", type=positive_int, default=40)
    ap.add_argument("--ckpt-interval", type=positive_int, default=300)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    explicit = {k for k in MODEL_FLAGS if getattr(args, k) is not None}
    for k, v in MODEL_FLAGS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.explicit_model_flags = explicit
    if args.n_embd % args.n_head:
        ap.error(f"argument --n-embd: {args.n_embd} is not divisible by --n-head {args.n_head}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        ap.error(f"argument --device: unknown device {args.device!r}")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        ap.error(f"argument --device: {args.device} is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        ap.error(f"argument --device: {args.device!r} is not supported (use cpu or cuda)")
    if not 0 <= args.dropout < 1:
        ap.error(f"argument --dropout: must be in [0, 1), got {args.dropout}")
    if args.min_lr < 0 or args.min_lr > args.lr:
        ap.error(f"argument --min-lr: must be in [0, --lr], got {args.min_lr}")
    if args.warmup_iters < 0:
        ap.error(f"argument --warmup-iters: must be >= 0, got {args.warmup_iters}")
    try:
        sizes = {s: len(data.load(s)) for s in ("train", "val")}
    except data.DataError as e:
        ap.error(str(e))
    if args.block_size + 1 > min(sizes.values()):
        ap.error(f"argument --block-size: {args.block_size} is larger than the data ({min(sizes.values())} bytes)")
    return args


def lr_at(it: int, args) -> float:
    """Linear warmup, then cosine decay to min_lr at max_iters."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    frac = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, frac))) * (args.lr - args.min_lr)


@torch.no_grad()
def evaluate(model, splits, args, device, seed: int) -> dict[str, float]:
    """Mean loss over eval_iters fixed batches per split (its own generator: training RNG untouched)."""
    model.eval()
    out = {}
    for name, arr in splits.items():
        gen = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(args.eval_iters):
            starts = torch.randint(len(arr) - args.block_size - 1, (args.batch_size,), generator=gen)
            x, y = data.batch(arr, starts, args.block_size)
            with autocast(device):
                losses.append(model(x.to(device), y.to(device))[1].item())
        out[name] = sum(losses) / len(losses)
    model.train()
    return out


def autocast(device: torch.device):
    # bf16 autocast on CUDA; fp32 on CPU (CPU bf16 matmuls are slow and the run is small)
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def plot(history: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in ("train", "val"):
        pts = [(h["step"], h[key]) for h in history if key in h]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=key)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None) -> dict:
    """Train; returns {"model", "loss", "history"} for tests and notebooks."""
    args = parse_args(argv)
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    device = torch.device(args.device)
    if ddp:
        import torch.distributed as dist

        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if args.threads:
        torch.set_num_threads(args.threads)
    master = rank == 0

    torch.manual_seed(args.seed + rank)  # dropout differs per rank; data does not
    random.seed(args.seed)
    batch_gen = torch.Generator().manual_seed(args.seed)
    cfg = GPTConfig(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
        dropout=args.dropout, norm=args.norm, fused=args.impl == "fused",
    )
    start, history = 0, []
    ckpt = None
    if args.resume:
        ckpt = checkpoint.resolve(args.out_dir)
        meta = checkpoint.read_meta(ckpt)
        saved = GPTConfig.from_json(meta["config"]["model"])
        for k in args.explicit_model_flags:
            if getattr(saved, k) != getattr(args, k):
                raise checkpoint.CheckpointError(
                    f"{ckpt / 'meta.json'}: config mismatch: checkpoint has {k}={getattr(saved, k)}, --{k.replace('_', '-')} {getattr(args, k)}"
                )
        cfg = GPTConfig(**{**saved.__dict__, "fused": args.impl == "fused"})
        start, history = meta["step"], meta.get("history", [])
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.optimizer_groups(args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    if ckpt is not None:
        checkpoint.load_weights(ckpt, model)
        rng = checkpoint.load_training_state(ckpt, meta, optimizer)
        batch_gen.set_state(rng["batches"])
        torch.set_rng_state(rng[f"torch{rank}"] if f"torch{rank}" in rng else rng["torch0"])
    train_model = model
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        # parameters and gradients are fp32 (autocast only lowers the matmuls), so the
        # gradient all-reduce runs in fp32
        train_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.compile:
        train_model = torch.compile(train_model)

    splits = {"train": data.load("train"), "val": data.load("val")}
    tokens_per_iter = args.batch_size * args.block_size * args.grad_accum * world
    if master:
        print(f"GPT {model.num_params() / 1e6:.2f}M params, {args.impl}, {device}, world {world}, "
              f"{tokens_per_iter} tokens/iter, iters {start}..{args.max_iters}", flush=True)

    def save(step: int) -> None:
        rng = {"batches": batch_gen.get_state(), "torch0": torch.get_rng_state()}
        checkpoint.save(
            args.out_dir, step, model, optimizer,
            {"model": cfg.to_json(), "train": {k: str(v) for k, v in vars(args).items()}},
            rng, extra={"history": history},
        )
        plot(history, args.out_dir / "loss.png")

    bar = None
    if master and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.max_iters, initial=start, dynamic_ncols=True, mininterval=1.0)
    t0, loss_val = time.perf_counter(), float("nan")
    for it in range(start, args.max_iters):
        for g in optimizer.param_groups:
            g["lr"] = lr_at(it, args)
        n_micro = world * args.grad_accum
        starts = torch.randint(len(splits["train"]) - args.block_size - 1, (n_micro, args.batch_size), generator=batch_gen)
        mine = starts[rank * args.grad_accum:(rank + 1) * args.grad_accum]
        total = torch.zeros((), device=device)
        for micro, st in enumerate(mine):
            x, y = (t.to(device) for t in data.batch(splits["train"], st, args.block_size))
            sync = not ddp or micro == args.grad_accum - 1  # all-reduce once, on the last micro-batch
            with (nullcontext() if sync else train_model.no_sync()), autocast(device):
                loss = train_model(x, y)[1] / args.grad_accum
            loss.backward()
            total += loss.detach()
        if ddp:
            torch.distributed.all_reduce(total)
            total /= world
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_val = total.item()
        step = it + 1
        if bar is not None:
            dt = time.perf_counter() - t0
            bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{(step - start) * tokens_per_iter / max(dt, 1e-9):,.0f}")
            bar.update(1)
        if step % args.eval_interval == 0 or step == args.max_iters:
            losses = evaluate(model, splits, args, device, seed=args.seed + 1)
            history.append({"step": step, **losses})
            if master:
                msg = f"step {step}: train {losses['train']:.4f}, val {losses['val']:.4f}"
                (bar.write(msg) if bar is not None else print(msg, flush=True))
        if master and (step % args.ckpt_interval == 0 or step == args.max_iters):
            save(step)
    if bar is not None:
        bar.close()
    if master:
        elapsed = time.perf_counter() - t0
        print(f"done: {args.max_iters - start} iters in {elapsed:.1f}s, "
              f"{(args.max_iters - start) * tokens_per_iter / max(elapsed, 1e-9):,.0f} tokens/s, last loss {loss_val:.4f}", flush=True)
    if ddp:
        torch.distributed.destroy_process_group()
    return {"model": model, "loss": loss_val, "history": history}


def cli(argv=None) -> None:
    """The command line: bad checkpoints and data are one-line errors with exit status 2."""
    try:
        main(argv)
    except (checkpoint.CheckpointError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
