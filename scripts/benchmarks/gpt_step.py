"""`bench.py gpt-step`: one training step (forward, backward, AdamW) of a GPT-2-small-shaped
model under bf16 autocast on a GPU: the fused stream against the naive one, each eager and
under torch.compile, four contenders side by side in one process; on a GPU each also
under torch.compile(mode="reduce-overhead") (the compiled step replayed as CUDA graphs),
and one more where
Liger-Kernel is importable on a GPU: the naive model with Liger's norms patched in
("naive+liger", `peers.liger_patch`), so the fused stream is measured against the peer too. The table gives each
contender's median step over --repeats runs with its min and max, tokens/s at the median,
and the speedup against naive eager. --quick is a toy model: with --device cpu, a smoke
test of this code for machines without a GPU."""
from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch

from . import peers
from .common import STEP_COLUMNS

COLUMNS = {**STEP_COLUMNS, "steps_per_run": "timed steps of each contender in a run (their median is the run's "
                                            "step time)"}

# GPT-2 small's shape (vocab padded to a multiple of 64, as nanoGPT does); 8 x 1024 tokens
# a step fit one H100 with the four models and their optimizers resident at once.
GPT2_SMALL = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
GPT2_BATCH = 8
TOY = dict(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=32)
TOY_BATCH = 2
CONTENDERS = ("naive", "naive+compile", "fused", "fused+compile")
# CUDA graphs need a GPU: on a CPU this mode is plain compilation, the "+compile" contenders again
REDUCE_OVERHEAD = ("naive+reduce-overhead", "fused+reduce-overhead")


def _autocast(dev: torch.device):
    # as scripts/train.py: bf16 autocast on CUDA; fp32 on CPU, where bf16 matmuls are slow
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _contender(name: str, shape: dict, dev: torch.device):
    """(model to call, optimizer) for one contender; the same seed gives every one the same weights."""
    from models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    # built as scripts/train.py builds it: fp32 parameters, the residual stream kept in fp32
    cfg = GPTConfig(**shape, fused=name.startswith("fused"), residual_dtype=torch.float32)
    model = GPT(cfg).to(dev)
    if name == "naive+liger":
        peers.liger_patch(model)
    opt = torch.optim.AdamW(model.optimizer_groups(0.1), lr=6e-4, betas=(0.9, 0.95))
    # static shapes: every step has the same one, so no recompile and no shape-generic kernels
    if name.endswith("+compile"):
        model = torch.compile(model, dynamic=False)
    elif name.endswith("+reduce-overhead"):
        model = torch.compile(model, dynamic=False, mode="reduce-overhead")
    return model, opt


def run(args) -> list[dict]:
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: the GPT step on a GPU needs one (nothing to do)")
        return []
    shape, B = (TOY, TOY_BATCH) if args.quick else (GPT2_SMALL, GPT2_BATCH)
    steps, warmup = (5, 2) if args.quick else (10, 3)
    names = CONTENDERS + (REDUCE_OVERHEAD if dev.type == "cuda" else ())
    if dev.type == "cuda" and peers.find()["liger"]["found"]:  # Liger's kernels need a GPU
        names += ("naive+liger",)
    contenders = {name: _contender(name, shape, dev) for name in names}
    gen = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, shape["vocab_size"], (B, shape["block_size"]), generator=gen).to(dev)
                    for _ in range(2))

    def step(model, opt):
        # A new step for CUDA graph trees (reduce-overhead): the last replay's outputs (loss,
        # gradients), all consumed by now, may be overwritten by this one's. Else a no-op.
        torch.compiler.cudagraph_mark_step_begin()
        with _autocast(dev):
            loss = model(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for model, opt in contenders.values():  # compile, allocate, and the optimizer's state
        for _ in range(warmup):
            step(model, opt)
    _sync(dev)
    runs = {k: [] for k in contenders}  # each run's median step time, s
    for _ in range(args.repeats):
        times = {k: [] for k in contenders}
        for _ in range(steps):  # alternate, so drift (clocks, heat, neighbours) hits every contender alike
            for k, (model, opt) in contenders.items():
                _sync(dev)
                t0 = time.perf_counter()
                step(model, opt)
                _sync(dev)
                times[k].append(time.perf_counter() - t0)
        for k, v in times.items():
            runs[k].append(statistics.median(v))
    tokens = B * shape["block_size"]
    rows = []
    for k, v in runs.items():
        up = [b / t for b, t in zip(runs["naive"], v, strict=True)]  # against the naive median of the same run
        rows.append(dict(impl=k, device=dev.type, n_layer=shape["n_layer"], n_embd=shape["n_embd"], batch=B,
                         tokens_per_step=tokens, runs=len(v), steps_per_run=steps,
                         median_ms=statistics.median(v) * 1e3, min_ms=min(v) * 1e3, max_ms=max(v) * 1e3,
                         tokens_per_s=tokens / statistics.median(v),
                         speedup_vs_naive=statistics.median(up), speedup_min=min(up), speedup_max=max(up)))
    return rows
