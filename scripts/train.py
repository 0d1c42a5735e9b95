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
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from models import checkpoint, data  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402

# Model flags default to None so that --resume can tell explicit values (checked against
# the checkpoint) from unset ones (taken from it); these are the fresh-run defaults.
MODEL_FLAGS = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "norm": "rms"}


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _number(s: str, ok, what: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not (math.isfinite(v) and ok(v)):
        raise argparse.ArgumentTypeError(f"must be {what}, got {s}")
    return v


def positive_float(s: str) -> float:
    return _number(s, lambda v: v > 0, "a positive number")


def nonnegative_float(s: str) -> float:
    return _number(s, lambda v: v >= 0, "a number >= 0")


def probability(s: str) -> float:
    return _number(s, lambda v: 0 <= v < 1, "in [0, 1)")


def parse_args(argv=None):
    d = MODEL_FLAGS
    ap = argparse.ArgumentParser(description="Train the fuseblock GPT on Shakespeare.")
    ap.add_argument("--out-dir", type=Path, default=Path("out/shakespeare"))
    ap.add_argument("--max-iters", type=positive_int, default=1000)
    ap.add_argument("--impl", choices=["fused", "naive"], default="fused", help="fused stream, or its naive twin")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    ap.add_argument("--n-layer", type=positive_int, default=None, help=f"default {d['n_layer']}")
    ap.add_argument("--n-head", type=positive_int, default=None, help=f"default {d['n_head']}")
    ap.add_argument("--n-embd", type=positive_int, default=None, help=f"default {d['n_embd']}")
    ap.add_argument("--block-size", type=positive_int, default=None, help=f"default {d['block_size']}")
    ap.add_argument("--norm", choices=["rms", "layer"], default=None, help=f"default {d['norm']}")
    ap.add_argument("--batch-size", type=positive_int, default=32, help="per micro-batch and rank")
    ap.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per step and rank")
    ap.add_argument("--lr", type=positive_float, default=2e-3)
    ap.add_argument("--min-lr", type=nonnegative_float, default=2e-4, help="the cosine's floor")
    ap.add_argument("--warmup-iters", type=int, default=50)
    ap.add_argument("--lr-decay-iters", type=positive_int, default=None, help="cosine length (default --max-iters)")
    ap.add_argument("--weight-decay", type=nonnegative_float, default=0.1)
    ap.add_argument("--grad-clip", type=nonnegative_float, default=1.0, help="max gradient norm, 0 for none")
    ap.add_argument("--dropout", type=probability, default=None, help="default 0, or the checkpoint's on --resume")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    ap.add_argument("--eval-interval", type=positive_int, default=250)
    ap.add_argument("--eval-iters", type=positive_int, default=25, help="batches per split and evaluation")
    ap.add_argument("--ckpt-interval", type=positive_int, default=250)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    args.explicit_model_flags = {k for k in d if getattr(args, k) is not None}
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.n_embd % args.n_head:
        ap.error(f"argument --n-embd: {args.n_embd} is not divisible by --n-head {args.n_head}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        ap.error(f"argument --device: unknown device {args.device!r}")
    if dev.type not in ("cpu", "cuda"):
        ap.error(f"argument --device: {args.device!r} is not supported (use cpu or cuda)")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        ap.error(f"argument --device: {args.device} is not available on this machine")
    if args.min_lr > args.lr:
        ap.error(f"argument --min-lr: {args.min_lr} is above --lr {args.lr}")
    if args.warmup_iters < 0:
        ap.error(f"argument --warmup-iters: must be >= 0, got {args.warmup_iters}")
    args.lr_decay_iters = args.lr_decay_iters or args.max_iters
    try:
        sizes = {s: len(data.load(s)) for s in ("train", "val")}
    except data.DataError as e:
        ap.error(str(e))
    if args.block_size + 1 >= min(sizes.values()):
        ap.error(f"argument --block-size: {args.block_size} is larger than the data ({min(sizes.values())} bytes of val)")
    return args


def lr_at(it: int, args) -> float:
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    frac = (it - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, frac))) * (args.lr - args.min_lr)


def autocast(device: torch.device):
    # bf16 autocast on CUDA; fp32 on CPU (CPU bf16 matmuls are slow and the run is small)
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


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


def plot(curve: list, history: list, path: Path) -> None:
    """Per-iteration training loss, and the evaluated train/val losses, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(curve) + 1), curve, lw=0.6, alpha=0.5, color="tab:blue", label="train (batch)")
    for key, color in (("train", "tab:blue"), ("val", "tab:orange")):
        pts = [(h["step"], h[key]) for h in history]
        if pts:
            ax.plot(*zip(*pts), marker="o", color=color, label=f"{key} (eval)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def main(argv=None) -> dict:
    """Train; returns {"model", "loss", "history", "curve"} for tests and notebooks."""
    t_start = time.perf_counter()
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
    batch_gen = torch.Generator().manual_seed(args.seed)
    # the stream stays fp32 under bf16 autocast (a no-op in fp32)
    cfg = GPTConfig(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
        dropout=args.dropout or 0.0, norm=args.norm, fused=args.impl == "fused", residual_dtype=torch.float32,
    )
    start, history, curve, ckpt = 0, [], [], None
    if args.resume:
        ckpt = checkpoint.resolve(args.out_dir)
        meta = checkpoint.read_meta(ckpt)
        saved = checkpoint.read_config(ckpt, meta)
        for k in sorted(args.explicit_model_flags):
            if getattr(saved, k) != getattr(args, k):
                raise checkpoint.CheckpointError(
                    f"{ckpt / 'meta.json'}: config mismatch: checkpoint has {k}={getattr(saved, k)}, "
                    f"--{k.replace('_', '-')} asks for {getattr(args, k)}"
                )
        dropout = saved.dropout if args.dropout is None else args.dropout
        cfg = GPTConfig(**{**saved.__dict__, "fused": args.impl == "fused", "dropout": dropout})
        for k in MODEL_FLAGS:  # unset flags take the checkpoint's values
            setattr(args, k, getattr(cfg, k))
        start, history, curve = meta["step"], meta.get("history", []), meta.get("curve", [])[: meta["step"]]
        if start >= args.max_iters:
            raise checkpoint.CheckpointError(f"{ckpt}: already at step {start}; pass a --max-iters above it to go on")
    elif master and (args.out_dir / "latest").exists():
        print(f"note: {args.out_dir} holds an earlier run's checkpoints; this fresh run replaces them at its "
              "first checkpoint (pass --resume to continue them instead)", flush=True)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.optimizer_groups(args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    if ckpt is not None:
        checkpoint.load_weights(ckpt, model)
        rng = checkpoint.load_training_state(ckpt, meta, optimizer)
        try:
            batch_gen.set_state(rng["batches"])
            if rank == 0:
                torch.set_rng_state(rng["torch0"])
            else:  # only rank 0's dropout RNG is saved; the others restart theirs from the step
                torch.manual_seed(args.seed + rank + 1_000_003 * start)
        except (KeyError, RuntimeError, TypeError) as e:
            raise checkpoint.CheckpointError(f"{ckpt / 'optimizer.safetensors'}: bad RNG state ({e})") from None
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

    fresh, unsaved, plotted = ckpt is None, None, -1

    def warn(msg: str) -> None:
        (bar.write if bar is not None else print)(f"warning: {msg}", file=sys.stderr)

    def save(step: int) -> None:
        """Checkpoint, and redraw the loss plot when there is a new evaluation or at the end.
        A failed write (a full disk) is reported and training goes on; the previous
        checkpoint stays intact."""
        nonlocal fresh, unsaved, plotted
        try:
            if fresh:
                checkpoint.clear(args.out_dir)
                fresh = False
            rng = {"batches": batch_gen.get_state(), "torch0": torch.get_rng_state()}
            train_cfg = {k: str(v) for k, v in vars(args).items()}
            checkpoint.save(args.out_dir, step, model, optimizer, {"model": cfg.to_json(), "train": train_cfg},
                            rng, extra={"history": history, "curve": curve})
            unsaved = None
        except OSError as e:
            unsaved = f"checkpoint at step {step} not written ({e.strerror or e}); the previous one is intact"
            warn(unsaved)
            return
        if len(history) != plotted or step == args.max_iters:
            try:
                plot(curve, history, args.out_dir / "loss.png")
                plotted = len(history)
            except OSError as e:
                warn(f"loss plot not written ({e.strerror or e})")

    bar = None
    if master and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.max_iters, initial=start, dynamic_ncols=True, mininterval=1.0, unit="it")
    t0, loss_val = time.perf_counter(), float("nan")
    for it in range(start, args.max_iters):
        for g in optimizer.param_groups:
            g["lr"] = lr_at(it, args)
        n_micro = world * args.grad_accum
        starts = torch.randint(len(splits["train"]) - args.block_size - 1, (n_micro, args.batch_size), generator=batch_gen)
        mine = starts[rank * args.grad_accum:(rank + 1) * args.grad_accum]  # (grad_accum, batch_size)
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
        curve.append(loss_val)
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
        n = args.max_iters - start
        print(f"done: {n} iters in {elapsed:.1f}s ({n * tokens_per_iter / max(elapsed, 1e-9):,.0f} tokens/s), "
              f"{time.perf_counter() - t_start:.1f}s in all, last batch loss {loss_val:.4f}", flush=True)
    if ddp:
        torch.distributed.destroy_process_group()
    if unsaved:
        raise checkpoint.CheckpointError(f"{args.out_dir}: {unsaved}")
    return {"model": model, "loss": loss_val, "history": history, "curve": curve}


def cli(argv=None) -> None:
    """The command line: bad checkpoints and data are one-line errors with exit status 2."""
    try:
        main(argv)
    except (checkpoint.CheckpointError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
