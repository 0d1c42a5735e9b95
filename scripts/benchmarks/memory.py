"""`bench.py memory`: activation memory a forward leaves for backward, per layer per token,
fused GPT against naive, measured two independent ways:

- `saved`: the distinct storages autograd saves for backward
  (torch.autograd.graph.saved_tensors_hooks), parameters excluded;
- `allocated`: the net bytes the forward's ops leave allocated (the torch profiler's
  memory events: allocations less frees), which also sees anything kept alive some other
  way than autograd saving it.

"Per layer" is the difference between two depths, divided by the layers between them
and the tokens, so the embedding, the head, the loss and the logits cancel.
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from .common import gpt

B, T = 4, 64


def saved(model, idx) -> tuple[int, int]:
    """(bytes, storages) of the distinct activation storages autograd keeps for backward
    (parameters excluded: they live anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
    del loss
    return sum(seen.values()), len(seen)


@contextlib.contextmanager
def _without_usdt_lines():
    """The CPU profiler (kineto, in C++) writes a `USDT:` trace line to the process's
    stderr at each start and stop, twice a measurement: stderr goes to a temporary file
    meanwhile, and every other line is passed on after."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not line.startswith("USDT:")))
            sys.stderr.flush()


def allocated(model, idx) -> int:
    """Net bytes the forward leaves allocated (on the CPU, where the model runs here), by
    the profiler's per-op memory accounting; the graph is held until the count is done.
    Triton's interpreter leaves storages in reference cycles (fuseblock's own code makes
    none: see docs/performance.md), so the collector runs inside the window: otherwise
    the count would depend on when it last ran."""
    gc.collect()
    with _without_usdt_lines(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _, loss = model(idx, idx)
        gc.collect()
    net = sum(e.self_cpu_memory_usage for e in prof.key_averages())
    del loss
    return net


def per_layer(norm: str, fused: bool, quick: bool) -> dict:
    """Both measures per layer per token for one model, at the depths `run` uses."""
    l1, l2 = (1, 2) if quick else (1, 3)
    idx = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    models = [gpt(fused, quick, norm, n) for n in (l1, l2)]
    (b1, n1), (b2, n2) = (saved(m, idx) for m in models)
    a1, a2 = (allocated(m, idx) for m in models)
    dim = models[0].config.n_embd
    tokens = (l2 - l1) * B * T
    per = (b2 - b1) / tokens
    return dict(norm=norm, impl="fused" if fused else "naive", n_embd=dim, bytes_per_layer_per_token=per,
                in_units_of_d_fp32=per / (4 * dim), allocated_per_layer_per_token=(a2 - a1) / tokens,
                storages_per_layer=(n2 - n1) / (l2 - l1), total_saved_MB=b2 / 1e6)


def run(args) -> list[dict]:
    rows = []
    for norm in ("rms", "layer"):
        naive, fused = (per_layer(norm, f, args.quick) for f in (False, True))
        for r in (naive, fused):
            r["saved_vs_naive"] = r["bytes_per_layer_per_token"] / naive["bytes_per_layer_per_token"]
            r["allocated_vs_naive"] = r["allocated_per_layer_per_token"] / naive["allocated_per_layer_per_token"]
            rows.append(r)
    return rows
