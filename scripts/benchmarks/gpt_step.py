"""`bench.py gpt-step`: one training step (forward, backward, AdamW) of a GPT-2-small-shaped
model under bf16 autocast on a GPU: the fused stream against the naive one, each eager and
under torch.compile, four contenders side by side in one process; on a GPU each also
under torch.compile(mode="reduce-overhead") (the compiled step replayed as CUDA graphs),
and one more where
Liger-Kernel is importable on a GPU: the naive model with Liger's norms patched in
("naive+liger", `peers.liger_patch`), so the fused stream is measured against the peer too. The table gives each
contender's median step over --repeats runs with its min and max, tokens/s at the median,
and the speedup against naive eager. --quick is a toy model: with --device cpu, a smoke
test of this code for machines without a GPU.

--model picks the model: gpt2 (GPT-2 small, 8 x 1024 tokens), llama (a Llama-shaped decoder,
scripts/benchmarks/llama_model.py: d = 2048, 16 layers, SwiGLU, RMSNorm, 4 x 2048 tokens),
or both (the default), one after the other in the same process on the same seed. GPT-2's
contenders stay resident together and take their steps in turn; the Llama's do not fit
one GPU together (about 11.4 GB of fp32 weights and AdamW state each, and the CUDA graphs'
pools), so each is built, warmed, timed over all runs and freed before the next: its
speedups pair run i of each with run i of naive, minutes apart. On a GPU each row has the
contender's peak memory: what it holds between steps (weights, AdamW state) plus the most
a step after its first allocated above that (torch.cuda.max_memory_allocated, reset
before every step; the warm-up steps count, as reduce-overhead records its CUDA graphs,
and the pool they allocate then, in them: a replay allocates nothing)."""
from __future__ import annotations

import gc
import statistics
import time
from contextlib import nullcontext

import torch

from . import peers
from .common import STEP_COLUMNS

COLUMNS = {**STEP_COLUMNS, "steps_per_run": "timed steps of each contender in a run (their median is the run's "
                                            "step time)",
           "steps_per_s": "1 / median_ms, with steps_per_s_min and _max from max_ms and min_ms",
           "peak_mib": "GPU only: MiB held between steps (weights, AdamW state, outputs) + the most a step "
                       "after the first allocated above that (torch.cuda.max_memory_allocated, reset per step; "
                       "reduce-overhead's graph pool as its recording step allocated it)"}

# GPT-2 small's shape (vocab padded to a multiple of 64, as nanoGPT does); 8 x 1024 tokens
# a step fit one H100 with the four models and their optimizers resident at once.
GPT2_SMALL = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
GPT2_BATCH = 8
TOY = dict(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=32)
TOY_BATCH = 2
# Llama-shaped: d 2048, 16 layers of 16 heads of 128, SwiGLU's hidden 5632 (8/3 d rounded up to
# 256, as Llama's), Llama-2's vocabulary; 4 x 2048 tokens a step
LLAMA = dict(vocab_size=32000, block_size=2048, n_layer=16, n_head=16, n_embd=2048, hidden=5632)
LLAMA_BATCH = 4
LLAMA_TOY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, hidden=128)
# model -> (shape, batch, --quick shape, --quick batch, contenders resident together)
MODELS = {"gpt2": (GPT2_SMALL, GPT2_BATCH, TOY, TOY_BATCH, True),
          "llama": (LLAMA, LLAMA_BATCH, LLAMA_TOY, TOY_BATCH, False)}
CONTENDERS = ("naive", "naive+compile", "fused", "fused+compile")
# CUDA graphs need a GPU: on a CPU this mode is plain compilation, the "+compile" contenders again
REDUCE_OVERHEAD = ("naive+reduce-overhead", "fused+reduce-overhead")


def _autocast(dev: torch.device):
    # as scripts/train.py: bf16 autocast on CUDA; fp32 on CPU, where bf16 matmuls are slow
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _memory(dev: torch.device) -> int:
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def _contender(name: str, model_name: str, shape: dict, dev: torch.device):
    """(model to call, optimizer) for one contender; the same seed gives every one the same weights."""
    from models.gpt import GPT, GPTConfig

    from .llama_model import Llama

    torch.manual_seed(0)
    fused = name.startswith("fused")
    if model_name == "llama":
        model = Llama(**shape, fused=fused).to(dev)
    else:  # built as scripts/train.py builds it: fp32 parameters, the residual stream kept in fp32
        model = GPT(GPTConfig(**shape, fused=fused, residual_dtype=torch.float32)).to(dev)
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
    names = list(MODELS) if args.model == "both" else [args.model]
    return [row for name in names for row in _measure(name, args, dev)]


def _measure(model_name: str, args, dev: torch.device) -> list[dict]:
    full, full_batch, toy, toy_batch, together = MODELS[model_name]
    shape, B = (toy, toy_batch) if args.quick else (full, full_batch)
    steps, warmup = (5, 2) if args.quick else (10, 3)
    names = CONTENDERS + (REDUCE_OVERHEAD if dev.type == "cuda" else ())
    if dev.type == "cuda" and peers.find()["liger"]["found"]:  # Liger's kernels need a GPU
        names += ("naive+liger",)
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

    runs = {k: [] for k in names}  # each run's median step time, s
    held, above = {}, dict.fromkeys(names, 0)  # bytes between steps; the most a step allocated above them

    def timed(k, model, opt) -> float:
        """One step of contender k, its seconds; on a GPU, its allocation above what was held before it."""
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        before = _memory(dev)
        t0 = time.perf_counter()
        step(model, opt)
        _sync(dev)
        t = time.perf_counter() - t0
        if dev.type == "cuda":
            above[k] = max(above[k], torch.cuda.max_memory_allocated(dev) - before)
        return t

    for group in [names] if together else [[k] for k in names]:
        contenders = {}
        for k in group:  # compile, allocate, and the optimizer's state
            _sync(dev)
            base = _memory(dev)
            contenders[k] = model, opt = _contender(k, model_name, shape, dev)
            step(model, opt)  # its AdamW state is allocated here, and held from then on: not counted above it
            for _ in range(warmup - 1):  # these count: reduce-overhead records its CUDA graphs' pool in them,
                timed(k, model, opt)  # which a replay reuses without allocating
            held[k] = _memory(dev) - base
        for _ in range(args.repeats):
            times = {k: [] for k in contenders}
            for _ in range(steps):  # alternate, so drift (clocks, heat, neighbours) hits every contender alike
                for k, (model, opt) in contenders.items():
                    times[k].append(timed(k, model, opt))
            for k, v in times.items():
                runs[k].append(statistics.median(v))
        del contenders, model, opt
        torch.compiler.reset()  # drops the compiled code and the CUDA graph trees (their pools) of this group
        gc.collect()
        if dev.type == "cuda":  # the next group's memory figures start from what this one left
            torch.cuda.empty_cache()
    tokens = B * shape["block_size"]
    rows = []
    for k, v in runs.items():
        up = [b / t for b, t in zip(runs["naive"], v, strict=True)]  # against the naive median of the same run
        med = statistics.median(v)
        row = dict(model=model_name, impl=k, device=dev.type, n_layer=shape["n_layer"], n_embd=shape["n_embd"],
                   batch=B, tokens_per_step=tokens, runs=len(v), steps_per_run=steps,
                   median_ms=med * 1e3, min_ms=min(v) * 1e3, max_ms=max(v) * 1e3,
                   steps_per_s=1 / med, steps_per_s_min=1 / max(v), steps_per_s_max=1 / min(v),
                   tokens_per_s=tokens / med,
                   speedup_vs_naive=statistics.median(up), speedup_min=min(up), speedup_max=max(up))
        if dev.type == "cuda":
            row["peak_mib"] = (held[k] + above[k]) / 2**20
        rows.append(row)
    return rows
