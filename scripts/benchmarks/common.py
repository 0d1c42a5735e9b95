"""What the subcommands share: the table they print, a CPU timer with do_bench's
interface, and the GPT the model benchmarks build."""
from __future__ import annotations

import json
import statistics
import time

import torch


def markdown(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))  # rows may differ (gpu: error columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = (r.get(c, "") for c in cols)
        lines.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in cells) + " |")
    return "\n".join(lines) + "\n"


def emit(rows: list[dict], as_json: bool, columns: dict[str, str] | None = None) -> None:
    """The rows as JSON lines, or as a table followed by `columns`' meaning of each of its
    columns that `columns` names."""
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return
    print(markdown(rows))
    names = [c for c in dict.fromkeys(k for r in rows for k in r) if c in (columns or {})]
    for c in names:
        print(f"- {c}: {columns[c]}")
    if names:
        print()


# The columns of the step-time tables (speed, gpt-step): each run times every variant in
# turn, step by step, and keeps each variant's median step.
STEP_COLUMNS = {
    "runs": "independent runs (--repeats)",
    "median_ms": "the median over runs of each run's median step time",
    "min_ms": "the fastest run's median step time",
    "max_ms": "the slowest run's median step time",
    "tokens_per_s": "tokens a step / median_ms",
    "speedup_vs_naive": "the median over runs of (naive's step / this step) within the same run: not "
                        "naive's median_ms / this median_ms, so the two can disagree when the runs differ",
    "speedup_min": "the lowest of those per-run ratios",
    "speedup_max": "the highest of those per-run ratios",
}


def cpu_bench(fn, warmup: float = 25, rep: float = 100, grad_to_none=None) -> float:
    """Median ms per call of fn: `triton.testing.do_bench`'s stand-in on the CPU, with its
    arguments meaning what they mean there. warmup and rep are budgets in ms, turned into
    call counts (at least one each) from the mean of 5 timed calls; grad_to_none: tensors
    whose .grad is cleared before each timed call, so gradients do not pile up."""
    fn()  # the first call compiles and allocates: not timed
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    estimate_ms = max((time.perf_counter() - t0) * 1e3 / 5, 1e-6)
    for _ in range(max(1, int(warmup / estimate_ms))):
        fn()
    ts = []
    for _ in range(max(1, int(rep / estimate_ms))):
        for t in grad_to_none or ():
            t.grad = None
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def gpt(fused: bool, quick: bool, norm: str = "rms", n_layer: int | None = None):
    """The small GPT of models/gpt.py that `memory` and `speed` measure, seeded."""
    from models.gpt import GPT, GPTConfig

    n_layer = n_layer or (2 if quick else 4)
    cfg = GPTConfig(block_size=64, n_layer=n_layer, n_head=4, n_embd=64 if quick else 128, norm=norm, fused=fused)
    torch.manual_seed(0)
    return GPT(cfg)
