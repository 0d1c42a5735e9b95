"""Train the small GPT on byte-level Shakespeare: CPU, one GPU, or N ranks via torchrun.

    python scripts/train.py --out-dir out/shakespeare --overwrite  # the `make train` run
    python scripts/train.py --out-dir out/shakespeare --resume   # continue from `latest`
    python scripts/train.py --out-dir out/shakespeare --resume ckpt-000500  # or from a kept checkpoint
    torchrun --standalone --nproc_per_node=2 scripts/train.py ... # DDP (gloo on CPU, nccl on GPU)
    torchrun --standalone --nproc_per_node=2 scripts/train.py --fsdp ...  # FSDP2: sharded
    torchrun --standalone --nproc_per_node=2 scripts/train.py --tp 2 ...  # tensor parallel
    torchrun --standalone --nproc_per_node=4 scripts/train.py --fsdp --tp 2 ...  # 2-D: FSDP2 x TP

Every rank draws the same global batch of dp * grad_accum micro-batches from one seeded
generator and takes its data-parallel rank's slice, so N data-parallel processes match one
process with N times the gradient accumulation. DDP replicates the model on every rank;
--fsdp shards its parameters, gradients and optimizer state (FSDP2's fully_shard, built on
the meta device); --tp N splits each layer's heads and MLP columns over groups of N ranks,
which see the same batches (models/tensor_parallel.py), so dp = world / N; --fsdp --tp N
runs FSDP2 over the dp dim of a (dp, N) mesh. Checkpoints are gathered whole, so any of
these layouts, or one process, resumes them.

One run writes to an --out-dir at a time (rank 0 holds its lock), and a fresh run into
one that holds another run's checkpoints needs --overwrite. Ctrl-C or SIGTERM finishes
the current step, writes a checkpoint and exits with 130 or 143; --resume then continues
bit-exactly with the settings the run was started with. A NaN or inf loss or gradient
norm stops the run before that step lands anywhere: exit 3, and the error names the last
checkpoint that passed the update check (models/update_check.py: a checkpoint whose
weights descend from a step that moved them by more than their own size is written as a
suspect, and `latest` does not move to it) and the command that continues from it. Exit
status 2: a usage error, a bad checkpoint, an unusable --out-dir, or a last checkpoint
that could not be written. The settings, their bounds and the check of a checkpoint's
record are in models/settings.py.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import shlex
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bootstrap: models/ (not in the wheel)

# Importing torch takes seconds. A Ctrl-C meanwhile is held until the imports are done
# (raised inside them, a library may print a traceback or swallow it), then gets the one
# line that one later in start-up gets.
INTERRUPTED = "error: interrupted before training started; nothing to save"
_held: list[int] = []
if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda signum, frame: _held.append(signum))

import torch  # noqa: E402

from models import build, checkpoint, data, plot, settings, sharded, update_check  # noqa: E402
from models.gpt import GPTConfig  # noqa: E402
from models.lock import OutDirError, OutDirLock, claim  # noqa: E402
from models.settings import MODEL_DEFAULTS, TRAIN_DEFAULTS, SettingsError, arg_type  # noqa: E402

if __name__ == "__main__":
    if _held:
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(130)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Train the fuseblock GPT on Shakespeare.",
        epilog="On --resume every model and training setting comes from the checkpoint. A training flag given "
               "with --resume replaces the recorded value and the run prints what changed (all but --seed may "
               "change; changing any but --max-iters, --eval-interval, --eval-iters and --ckpt-interval makes a "
               "different run). A longer --max-iters keeps the recorded learning-rate schedule unless "
               "--lr-decay-iters is given. Ctrl-C or SIGTERM: the current step finishes, a checkpoint is "
               "written, exit 130 / 143. A NaN or inf loss or gradient norm stops the run unsaved, exit 3, and "
               "prints the command that continues from the last checkpoint that passed the update check. "
               "Exit 2: a usage error, a bad checkpoint, an unusable or busy --out-dir, or a last checkpoint "
               "that could not be written.")
    run = ap.add_argument_group("this invocation (not recorded)")
    run.add_argument("--out-dir", type=Path, default=Path("out/shakespeare"),
                     help="checkpoints, `latest` and loss.png go here; one run at a time (default: out/shakespeare)")
    fresh = run.add_mutually_exclusive_group()
    fresh.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                       help="continue from a checkpoint in --out-dir: the one `latest` names, or a kept one by name "
                            "(ckpt-000010) or path (default: off, a fresh run)")
    fresh.add_argument("--overwrite", action="store_true",
                       help="let a fresh run replace the checkpoints of another run in --out-dir, once its own first "
                            "one is written (default: off, such a run is refused)")
    run.add_argument("--resume-step", type=arg_type("count"), default=None, metavar="N",
                     help="continue from the kept checkpoint of step N in --out-dir; implies --resume (default: off)")
    run.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    run.add_argument("--threads", type=arg_type("count"), default=None, help="CPU threads (default: torch's choice)")
    run.add_argument("--compile", action="store_true", help="torch.compile the model (default: off)")
    run.add_argument("--fsdp", action="store_true",
                     help="under torchrun, shard parameters, gradients and optimizer state over the ranks (FSDP2) "
                          "instead of replicating the model (DDP); same results, same checkpoints (default: off)")
    run.add_argument("--tp", type=arg_type("count"), default=1, metavar="N",
                     help="under torchrun, tensor parallelism over groups of N ranks: heads and MLP columns split, "
                          "activations sharded by sequence; without --fsdp N is the world size, with it the 2-D "
                          "mesh (world / N, N) (default: 1, off)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar (default: off, a tqdm bar)")

    settings.add_flags(ap.add_argument_group("model (recorded; on --resume they must match the checkpoint)"),
                       MODEL_DEFAULTS)
    settings.add_flags(ap.add_argument_group("training (recorded; --resume restores them, and a value given with "
                                             "it replaces the recorded one with a printed note)"), TRAIN_DEFAULTS)
    return ap


def parse_args(argv=None):
    """Flags, checked before any work. A fresh run's settings are filled in here; a
    resumed run's come from its checkpoint (settings.resume)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    args.explicit = {k for k in (*MODEL_DEFAULTS, *TRAIN_DEFAULTS) if getattr(args, k) is not None}
    if args.resume_step is not None:
        if args.overwrite:
            ap.error("argument --resume-step: not allowed with argument --overwrite")
        args.resume = args.resume or "latest"
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
    if args.fsdp and not launched_by_torchrun():
        ap.error("argument --fsdp: shards over torchrun's ranks; run it as "
                 "torchrun --standalone --nproc_per_node=N scripts/train.py --fsdp ...")
    if args.tp > 1:
        world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1
        if world == 1:
            ap.error(f"argument --tp: splits the model over torchrun's ranks; run it as "
                     f"torchrun --standalone --nproc_per_node={args.tp} scripts/train.py --tp {args.tp} ...")
        if world % args.tp or not (args.fsdp or world == args.tp):
            ap.error(f"argument --tp: {args.tp} on {world} ranks: without --fsdp the tensor-parallel group is every "
                     f"rank (--tp {world}); with --fsdp, --tp must divide the world size")
    for k, v in MODEL_DEFAULTS.items():  # on --resume, replaced by the checkpoint's
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.n_embd % args.n_head:
        ap.error(f"argument --n-embd: {args.n_embd} is not divisible by --n-head {args.n_head}")
    if args.hc and args.norm != "rms":
        ap.error(f"argument --hc: {args.hc} streams normalize with RMS norms; --norm {args.norm} is not supported")
    if args.hc and args.tp > 1:
        ap.error(f"argument --hc: tensor parallelism (--tp {args.tp}) splits the plain stack only")
    if args.attn_res and (args.norm != "rms" or args.hc or args.tp > 1):
        ap.error(f"argument --attn-res: needs --norm rms, no --hc and no --tp (got --norm {args.norm}, --hc {args.hc}, "
                 f"--tp {args.tp})")
    if not args.resume:
        for k, v in TRAIN_DEFAULTS.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        args.lr_decay_iters = args.lr_decay_iters or args.max_iters
        problem = settings.conflict(args) or settings.model_conflict(args, args.tp)
        if problem:
            ap.error(f"argument {problem.split()[0]}: {problem}")
    try:
        sizes = {s: len(data.load(s)) for s in ("train", "val")}
    except data.DataError as e:
        ap.error(str(e))
    if args.block_size + 1 >= min(sizes.values()):
        ap.error(f"argument --block-size: {args.block_size} is larger than the data "
                 f"({min(sizes.values())} bytes of val)")
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


# ----------------------------------------------------------------------------- setup steps


@dataclass
class Dist:
    distributed: bool  # launched by torchrun: one process group of `world` ranks
    rank: int
    world: int
    device: torch.device
    fsdp: bool = False  # the model sharded over the data-parallel ranks (FSDP2); else replicated (DDP)
    tp: int = 1  # ranks per tensor-parallel group, consecutive ranks: rank = dp_rank * tp + tp_rank

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each draws its own micro-batches; a tensor-parallel group shares them."""
        return self.world // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def sharded(self) -> bool:
        """The parameters are DTensors (FSDP2, tensor parallelism, or both): every rank joins
        the gathering of a checkpoint."""
        return self.fsdp or self.tp > 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(args) -> Dist:
    distributed = launched_by_torchrun()
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if distributed else (0, 1)
    device = torch.device(args.device)
    if distributed:
        import torch.distributed as dist

        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if args.threads:
        torch.set_num_threads(args.threads)
    return Dist(distributed, rank, world, device, fsdp=args.fsdp, tp=args.tp)


def claim_out_dir(args, dist: Dist) -> OutDirLock | None:
    """Rank 0 checks --out-dir and locks it before any training, and refuses a fresh run
    into another run's checkpoints unless --overwrite says so; under torchrun the other
    ranks learn the outcome from it, so that all stop together instead of waiting on rank 0."""
    lock, error = None, None
    if dist.master:
        try:
            if args.resume and not args.out_dir.is_dir():
                raise checkpoint.CheckpointError(f"{args.out_dir}: no checkpoint here (no such directory)")
            lock = claim(args.out_dir, create=not args.resume)
            if not (args.resume or args.overwrite) and checkpoint.checkpoint_names(args.out_dir):
                lock.release()
                raise OutDirError(f"--out-dir {args.out_dir} holds another run's checkpoints: pass --resume to "
                                  "continue that run, or --overwrite to replace it with this one")
        except (OutDirError, checkpoint.CheckpointError) as e:
            lock, error = None, e
    if dist.distributed:
        ok = torch.tensor([0.0 if error else 1.0], device=dist.device)
        torch.distributed.broadcast(ok, src=0)
        if not dist.master and ok.item() == 0:
            raise OutDirError(f"rank {dist.rank}: rank 0 could not use --out-dir {args.out_dir}")
    if error:
        raise error
    return lock


@dataclass
class Run:
    """Everything the training loop reads and updates."""
    args: argparse.Namespace
    dist: Dist
    cfg: GPTConfig
    model: torch.nn.Module
    train_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch_gen: torch.Generator
    splits: dict
    start: int
    history: list
    curve: list
    supersedes: tuple  # an earlier run's checkpoints, removed once this run's first that passed is written
    last_saved: int  # step of the checkpoint `latest` names (the last that passed), 0 for none of this run
    check: update_check.UpdateCheck
    unsaved: str | None = None  # why the newest checkpoint attempt failed, if it did
    suspect: str | None = None  # why this run's checkpoints since a step are suspects, once one is
    plotted: int = -1
    bar: object = None
    times: dict = field(default_factory=lambda: {"train": 0.0, "eval": 0.0, "ckpt": 0.0})

    @property
    def tokens_per_iter(self) -> int:
        a = self.args
        return a.batch_size * a.block_size * a.grad_accum * self.dist.dp

    def say(self, msg: str, err: bool = False) -> None:
        """A line for the user (rank 0 only), above the progress bar when there is one."""
        if not self.dist.master:
            return
        stream = sys.stderr if err else sys.stdout
        if self.bar is not None:
            self.bar.write(msg, file=stream)
        else:
            print(msg, file=stream, flush=True)


def build_run(args, dist: Dist) -> tuple[Run, list[str]]:
    """Model, optimizer and RNGs: fresh from the seed, or restored from the checkpoint."""
    notes, ckpt, meta, recorded = [], None, None, {}
    if args.resume:
        ckpt = checkpoint.resume_point(args.out_dir, args.resume, args.resume_step)
        meta = checkpoint.read_meta(ckpt)
        saved = checkpoint.read_config(ckpt, meta)
        notes = checkpoint.resume_notes(args.out_dir, ckpt, meta)
        notes += settings.describe_changes(*settings.resume(args, meta, saved, dist.dp, ckpt))
        problem = settings.model_conflict(args, dist.tp)
        if problem:
            raise SettingsError(f"{ckpt}: {problem} (the checkpoint's model settings)")
        recorded = saved.__dict__  # its norm_eps and bias too, which no flag sets
    # the stream stays fp32 under bf16 autocast (a no-op in fp32)
    cfg = GPTConfig(**{**recorded, **{k: getattr(args, k) for k in MODEL_DEFAULTS}, "dropout": args.dropout,
                       "fused": args.impl == "fused", "residual_dtype": torch.float32})
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    try:
        model = build.gpt(cfg, dist)
    except RuntimeError as e:  # torch.OutOfMemoryError too
        if not any(m in str(e) for m in ("Storage size calculation overflowed", "can't allocate", "out of memory")):
            raise
        raise SettingsError(f"--n-layer {cfg.n_layer} --n-embd {cfg.n_embd}: a model of about "
                            f"{12 * cfg.n_layer * cfg.n_embd ** 2:.3g} weights does not fit on {dist.device} "
                            f"({str(e).splitlines()[0][:160]})") from None
    if dist.rank:
        torch.manual_seed(args.seed + dist.rank)  # dropout differs per rank; data does not
    batch_gen = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(model.optimizer_groups(args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    start, history, curve, supersedes = 0, [], [], ()
    if ckpt is not None:
        checkpoint.load_weights(ckpt, model)
        rng = checkpoint.load_training_state(ckpt, meta, optimizer)
        optimizer.param_groups[0]["weight_decay"] = args.weight_decay  # the decay group; the checkpoint's otherwise
        batch_gen.set_state(rng["batches"])
        start, history, curve = meta["step"], meta["history"], meta["curve"]
        if dist.master:
            torch.set_rng_state(rng["torch0"])
        else:  # only rank 0's dropout RNG is saved; the others restart theirs from the step
            torch.manual_seed(args.seed + dist.rank + 1_000_003 * start)
    elif dist.master:
        supersedes = checkpoint.checkpoint_names(args.out_dir)
        if supersedes:  # --overwrite said so (claim_out_dir)
            notes.append(f"note: --overwrite: {args.out_dir} holds another run's checkpoints; they stay until this "
                         "fresh run's first checkpoint is written, then go")
    train_model = model
    if dist.distributed and not dist.sharded:
        from torch.nn.parallel import DistributedDataParallel

        # parameters and gradients are fp32 (autocast only lowers the matmuls), so the
        # gradient all-reduce runs in fp32
        device_ids = [dist.device.index] if dist.device.type == "cuda" else None
        train_model = DistributedDataParallel(model, device_ids=device_ids)
    if args.compile:
        train_model = torch.compile(train_model)
    splits = {"train": data.load("train"), "val": data.load("val")}
    run = Run(args, dist, cfg, model, train_model, optimizer, batch_gen, splits, start, history, curve,
              supersedes, last_saved=checkpoint.latest_step(args.out_dir) if ckpt is not None else 0,
              check=update_check.UpdateCheck(model))
    return run, notes


# ----------------------------------------------------------------------------- the loop


class StopSignals:
    """SIGINT and SIGTERM ask the run to stop after the current step, with a checkpoint,
    instead of killing it mid-step. Later signals are only noted, so that nothing (a
    second Ctrl-C, torchrun's SIGTERM after the SIGINT) cuts that checkpoint short;
    SIGKILL still does, and the previous checkpoint survives it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = 0
        self._previous = {}

    def _handle(self, signum, frame):
        self.signum = self.signum or signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signal.signal works there only
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def gradient_sync(run: Run, last: bool):
    """Gradients are averaged over the data-parallel ranks once per step, after its last
    micro-batch: DDP holds its all-reduce under no_sync, FSDP2 its reduce-scatter while sync
    is off. Tensor parallelism alone has no data-parallel ranks to average over."""
    if run.dist.fsdp:
        run.model.set_requires_gradient_sync(last)
    elif run.dist.distributed and not run.dist.sharded and not last:
        return run.train_model.no_sync()
    return nullcontext()


class Diverged(RuntimeError):
    """A NaN or inf loss or gradient norm: the run stops before the step lands anywhere."""


def train_step(run: Run, it: int, stop: StopSignals) -> tuple[float, int]:
    """One optimizer step; returns its loss, averaged over ranks, and the signal that
    stops the run after it (0 for none), agreed by all ranks in the loss's all-reduce so
    that every rank stops at the same step. A NaN or inf loss or gradient norm raises
    Diverged before the optimizer steps (every rank sees the same reduced values)."""
    args, dist = run.args, run.dist
    for g in run.optimizer.param_groups:
        g["lr"] = lr_at(it, args)
    n_micro = dist.dp * args.grad_accum
    starts = torch.randint(len(run.splits["train"]) - args.block_size - 1, (n_micro, args.batch_size),
                           generator=run.batch_gen)
    mine = starts[dist.dp_rank * args.grad_accum:(dist.dp_rank + 1) * args.grad_accum]  # (grad_accum, batch_size)
    total = torch.zeros((), device=dist.device)
    for micro, st in enumerate(mine):
        x, y = (t.to(dist.device) for t in data.batch(run.splits["train"], st, args.block_size))
        with gradient_sync(run, micro == args.grad_accum - 1), autocast(dist.device):
            loss = run.train_model(x, y)[1] / args.grad_accum
        loss.backward()
        total += loss.detach()
    signum = stop.signum
    if dist.distributed:
        flags = torch.tensor([signum == signal.SIGINT, signum == signal.SIGTERM], dtype=torch.float32,
                             device=dist.device)
        stats = torch.cat([total.reshape(1), flags])
        torch.distributed.all_reduce(stats)
        total = stats[0] / dist.world  # a tensor-parallel group's ranks hold one loss: the mean is the dp mean
        signum = signal.SIGINT if stats[1] > 0 else signal.SIGTERM if stats[2] > 0 else 0  # Ctrl-C wins
    # the global norm (of the shards, under --fsdp or --tp); clipping at inf scales by 1.0, bit-exact
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), args.grad_clip or math.inf)
    norm = norm.full_tensor() if sharded.is_shard(norm) else norm
    loss, norm = torch.stack([total, norm.to(total)]).tolist()  # one device sync
    if not (math.isfinite(loss) and math.isfinite(norm)):
        raise Diverged(f"step {it + 1} (loss {loss}, gradient norm {norm})")
    run.check.before_step()
    run.optimizer.step()
    run.check.after_step(it + 1)
    run.optimizer.zero_grad(set_to_none=True)
    return loss, int(signum)


def save(run: Run, step: int) -> None:
    """Checkpoint (rank 0; under --fsdp or --tp every rank joins the gathering of the shards), and
    redraw the loss plot when there is a new evaluation or at the end. A failed write (a
    full disk) is a warning and training goes on; `latest` and what it names stay as they
    were. A checkpoint that fails the update check is written as a suspect: `latest` stays
    on the last that passed, and the first suspect of a run is a warning."""
    args = run.args
    rng = {"batches": run.batch_gen.get_state(), "torch0": torch.get_rng_state()}
    settings = {k: getattr(args, k) for k in TRAIN_DEFAULTS}
    # the data-parallel world: what the batches depend on (a --tp 2 run on 2 ranks draws one process's)
    config = {"model": run.cfg.to_json(), "train": settings, "world_size": run.dist.dp}
    verdict = run.check.verdict()
    try:
        written = checkpoint.save(args.out_dir, step, run.model, run.optimizer, config, rng,
                                  extra={"history": run.history, "curve": run.curve, "update": verdict},
                                  supersedes=run.supersedes, passed=verdict["passed"])
    except checkpoint.NonFiniteError:
        raise Diverged(f"step {step} (NaN or inf weights or optimizer state)") from None
    except checkpoint.CheckpointWriteError as e:
        kept = (f"{args.out_dir}/latest still holds step {run.last_saved}" if run.last_saved
                else "the earlier run's latest checkpoint is intact" if run.supersedes
                else f"{args.out_dir} has no latest yet")
        head = (f"checkpoint at step {step} written to {e.placed} but latest not moved to it" if e.placed
                else f"checkpoint at step {step} not written")
        freed = f"; {', '.join(e.freed)} removed to make room" if e.freed else ""
        run.unsaved = f"{head} ({e.reason}{freed}); {kept}"
        run.say(f"warning: {run.unsaved}", err=True)
        return
    if not run.dist.master:  # under --fsdp or --tp the other ranks only joined the gathering
        return
    name = f"ckpt-{step:06d}"
    if not verdict["passed"] and run.suspect is None:
        run.suspect = (f"step {verdict['step']} moved the weights by {verdict['largest']:.3g} times their size, "
                       f"above the update check's limit of {verdict['limit']:g}")
        kept = f"latest stays at ckpt-{run.last_saved:06d}" if run.last_saved else "latest not moved"
        run.say(f"warning: {args.out_dir}: {run.suspect}: {name} and this run's later checkpoints, whose weights "
                f"descend from that step, are written as suspects; {kept}", err=True)
    if written is None:  # a suspect under the name of the checkpoint `latest` names, which it does not replace
        run.unsaved = f"suspect checkpoint at step {step} not written: {name} is the last that passed"
        run.say(f"warning: {run.unsaved}", err=True)
        return
    run.unsaved = None
    if verdict["passed"]:
        run.last_saved, run.supersedes = step, ()
    if len(run.history) != run.plotted or step == args.max_iters:
        try:
            plot.loss_plot(run.curve, run.history, args.out_dir / "loss.png")
            run.plotted = len(run.history)
        except OSError as e:
            run.say(f"warning: loss plot not written ({e.strerror or e})", err=True)


@contextmanager
def timed(run: Run, phase: str):
    """Adds the time of a `with` block to run.times[phase]: the closing tokens/s counts
    training alone, with evaluation and checkpoints reported apart."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        run.times[phase] += time.perf_counter() - t0


def train_loop(run: Run, stop: StopSignals) -> tuple[float, int, int]:
    """Train from run.start to --max-iters, or to the step a signal stopped at; returns
    the last loss, the last step, and the stopping signal (0 for none)."""
    args = run.args
    loss, step, signum = float("nan"), run.start, 0
    for it in range(run.start, args.max_iters):
        with timed(run, "train"):
            loss, signum = train_step(run, it, stop)
        run.curve.append(loss)
        step = it + 1
        if run.bar is not None:
            rate = (step - run.start) * run.tokens_per_iter / max(run.times["train"], 1e-9)
            run.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}")
            run.bar.update(1)
        if step % args.eval_interval == 0 or step == args.max_iters:
            with timed(run, "eval"):
                losses = evaluate(run.model, run.splits, args, run.dist.device, seed=args.seed + 1)
            if not all(map(math.isfinite, losses.values())):
                raise Diverged(f"step {step} (evaluated losses {losses})")
            run.history.append({"step": step, **losses})
            run.say(f"step {step}: train {losses['train']:.4f}, val {losses['val']:.4f}")
        due = step % args.ckpt_interval == 0 or step == args.max_iters or signum
        if due and (run.dist.master or run.dist.sharded):
            with timed(run, "ckpt"):
                save(run, step)
        if signum:
            break
    return loss, step, signum


def release_shards() -> None:
    """Free an --fsdp or --tp model before its process group goes. FSDP2's hooks put the model in
    reference cycles that hold the group; left to the interpreter's exit, they outlive it,
    and gloo's threads are torn down out of order: 2 of 16 two-rank runs on CPU aborted at
    exit ("terminate called without an active exception"), 0 of 16 with this. An error on
    its way out holds the model in its traceback's frames, so their locals go first."""
    error = sys.exc_info()[1]
    if error is not None:
        traceback.clear_frames(error.__traceback__)
    gc.collect()


def main(argv=None) -> dict:
    """Train; returns {"model", "loss", "history", "curve", "signal", "iters", "times"} for tests and
    notebooks ("signal": the SIGINT or SIGTERM that stopped the run early, else 0;
    "model": None under --fsdp or --tp, whose shards go with the process group: the last
    checkpoint holds the whole model)."""
    t_start = time.perf_counter()
    args = parse_args(argv)
    dist = init_distributed(args)
    try:
        with StopSignals() as stop:
            lock = claim_out_dir(args, dist)
            try:
                return _train(args, dist, stop, t_start)
            finally:
                if lock is not None:
                    lock.release()
    finally:
        if dist.sharded:
            release_shards()
        if dist.distributed:
            torch.distributed.destroy_process_group()


def _train(args, dist: Dist, stop: StopSignals, t_start: float) -> dict:
    run, notes = build_run(args, dist)
    for line in notes:
        run.say(line)
    layout = f" (dp {dist.dp} x tp {dist.tp})" if dist.tp > 1 else ""
    run.say(f"GPT {run.model.num_params() / 1e6:.2f}M params, {args.impl}, {dist.device}, world {dist.world}{layout}, "
            f"{run.tokens_per_iter} tokens/iter, iters {run.start}..{args.max_iters}")
    if dist.master and not args.no_progress:
        from tqdm import tqdm

        run.bar = tqdm(total=args.max_iters, initial=run.start, dynamic_ncols=True, mininterval=1.0, unit="it")
    try:
        loss, step, signum = train_loop(run, stop)
    except Diverged as e:
        raise Diverged(f"{args.out_dir}: training diverged at {e}; nothing of it was saved; {way_back(run)}") from None
    finally:
        if run.bar is not None:
            run.bar.close()
            run.bar = None
    t = run.times
    n = step - run.start
    run.say(f"done: {n} iters, training {t['train']:.1f}s ({n * run.tokens_per_iter / max(t['train'], 1e-9):,.0f} "
            f"tokens/s), evaluation {t['eval']:.1f}s, checkpoints {t['ckpt']:.1f}s, "
            f"{time.perf_counter() - t_start:.1f}s in all, last batch loss {loss:.4f}")
    if run.unsaved:  # the last checkpoint is what the user runs next from: its loss is an error
        stopped = f"stopped by {signal.Signals(signum).name} after step {step}, but " if signum else ""
        raise checkpoint.CheckpointError(f"{args.out_dir}: {stopped}{run.unsaved}")
    if signum:
        how = f" as a suspect; --resume ckpt-{step:06d} continues from it" if run.suspect else "; --resume continues"
        run.say(f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint "
                f"{args.out_dir / f'ckpt-{step:06d}'} written{how}", err=True)
    elif run.suspect:
        held = f"ckpt-{run.last_saved:06d}" if run.last_saved else "none of this run's"
        run.say(f"warning: {args.out_dir}: latest names {held}, not this run's last checkpoint: {run.suspect}; "
                f"--resume ckpt-{step:06d} continues from it all the same", err=True)
    return {"model": None if dist.sharded else run.model, "loss": loss, "history": run.history, "curve": run.curve,
            "signal": signum, "iters": n, "times": dict(t)}


def way_back(run: Run) -> str:
    """After a divergence: the last checkpoint that passed the update check (the one
    `latest` names) and the command that continues from it, or, when this run has none,
    the command that starts it again (settings.continue_flags)."""
    args, dist = run.args, run.dist
    good = checkpoint.pointer_target(args.out_dir) if run.last_saved else None
    recorded = None
    if good is not None:
        try:
            recorded = checkpoint.read_meta(args.out_dir / good)["config"]["train"]
        except (checkpoint.CheckpointError, KeyError):
            good = None
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    script = os.path.relpath(__file__)
    script = script if not script.startswith("..") else os.path.abspath(__file__)
    launch = f"torchrun --standalone --nproc_per_node={dist.world}" if dist.distributed else "python"
    flags = settings.continue_flags(args, recorded, good, default_device)
    command = " ".join([launch, shlex.quote(script), *map(shlex.quote, flags)])
    why = f" ({run.suspect})" if run.suspect else ""
    if good:
        return (f"{good} is the last checkpoint that passed the update check (latest names it)"
                f"{'; the ones after it are suspects' + why if why else ''}; to go on: {command}")
    return f"this run has no checkpoint that passed the update check{why}; to start it again: {command}"


def cli(argv=None) -> None:
    """The command line: bad checkpoints, data, settings and output directories are one-line
    errors with exit status 2, a diverged run one with 3; a run stopped by SIGINT or
    SIGTERM exits 130 or 143."""
    try:
        result = main(argv)
    except (checkpoint.CheckpointError, OutDirError, SettingsError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
    except KeyboardInterrupt:  # a Ctrl-C before the handlers are in place: nothing trained yet
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(130)
    if result["signal"]:
        sys.exit(128 + result["signal"])


if __name__ == "__main__":
    cli()
