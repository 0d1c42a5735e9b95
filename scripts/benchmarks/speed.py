"""`bench.py speed`: CPU training-step time of the naive and fused GPT (and, without
--quick, torch.compile of each), as the median of --repeats runs with their min and max."""
from __future__ import annotations

import statistics
import time

import torch

from .common import STEP_COLUMNS, gpt

COLUMNS = STEP_COLUMNS


def run(args) -> list[dict]:
    steps = 5 if args.quick else 20
    B = 8 if args.quick else 32
    impls = {}
    for fused in (False, True):
        model = gpt(fused, args.quick)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        impls["fused" if fused else "naive"] = (model, opt)
        if not args.quick:
            # fullgraph: a graph break would fail here rather than silently split the step
            impls[("fused" if fused else "naive") + "+compile"] = (torch.compile(model, fullgraph=True), opt)
    idx = torch.randint(0, 256, (B, 64))
    for m, opt in impls.values():  # warm up (and compile)
        m(idx, idx)[1].backward()
        opt.zero_grad()
    runs = {k: [] for k in impls}  # each run's median step time
    for _ in range(args.repeats):
        times = {k: [] for k in impls}
        for _ in range(steps):  # alternate, so drift hits every variant alike
            for k, (m, opt) in impls.items():
                t0 = time.perf_counter()
                m(idx, idx)[1].backward()
                opt.step()
                opt.zero_grad()
                times[k].append(time.perf_counter() - t0)
        for k, v in times.items():
            runs[k].append(statistics.median(v))
    rows = []
    for k, v in runs.items():
        up = [b / t for b, t in zip(runs["naive"], v, strict=True)]  # against the naive median of the same run
        rows.append(dict(impl=k, runs=len(v), median_ms=statistics.median(v) * 1e3, min_ms=min(v) * 1e3,
                         max_ms=max(v) * 1e3, tokens_per_s=B * 64 / statistics.median(v),
                         speedup_vs_naive=statistics.median(up), speedup_min=min(up), speedup_max=max(up)))
    return rows
