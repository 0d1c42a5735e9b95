"""`bench.py memory`: bytes autograd saves for backward per layer per token, fused GPT
against naive."""
from __future__ import annotations

import torch

from .common import gpt


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


def run(args) -> list[dict]:
    """Per layer = (saved with L2 layers - saved with L1 layers) / (L2 - L1): embedding,
    head and loss cancel out."""
    B, T = 4, 64
    l1, l2 = (1, 2) if args.quick else (1, 3)
    rows = []
    for norm in ("rms", "layer"):
        for fused in (False, True):
            idx = torch.randint(0, 256, (B, T))
            (b1, n1), (b2, n2) = (saved(gpt(fused, args.quick, norm, n), idx) for n in (l1, l2))
            dim = gpt(fused, args.quick, norm, 1).config.n_embd
            per = (b2 - b1) / ((l2 - l1) * B * T)
            rows.append(dict(norm=norm, impl="fused" if fused else "naive", n_embd=dim,
                             bytes_per_layer_per_token=per, in_units_of_d_fp32=per / (4 * dim),
                             storages_per_layer=(n2 - n1) / (l2 - l1), total_saved_MB=b2 / 1e6))
    return rows
