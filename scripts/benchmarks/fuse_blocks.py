"""`bench.py fuse-blocks`: the training step (forward, backward, AdamW) of each host model
of fuseblock/testing/host_models.py (nanoGPT, timm ViT, litgpt, torchtitan) as written and
after one `fuseblock.fuse_blocks` call, in the same process on the torch path: each
style's median step over --repeats runs with their min and max, and the fused / original
ratio (the median, min and max of the per-run ratios). The two models of a style share
their weights' values and step alternately, so drift hits both alike. --quick: the tiny
test configurations."""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F

from fuseblock import fuse_blocks
from fuseblock.testing import host_models as hm

COLUMNS = {
    "original_ms": "the median over runs of each run's median step of the model as written",
    "fused_ms": "the same after fuse_blocks",
    "ratio": "fused / original: the median of the per-run ratios (below 1: the fused step is faster)",
    "ratio_min": "the lowest per-run ratio",
    "ratio_max": "the highest per-run ratio",
}


def _styles(quick: bool):
    """(name, model, fuse(model), inputs, targets) for each style; d = 256, 4 layers, 4 x 128
    tokens (the ViT: 4 images of 64 patches), or the tiny test shapes with --quick."""
    d, layers, heads, seq, batch = (32, 2, 2, 8, 2) if quick else (256, 4, 4, 128, 4)
    vocab = 64 if quick else 512
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)

    gpt = hm.GPT(hm.GPTConfig(block_size=seq, vocab_size=vocab, n_layer=layers, n_head=heads, n_embd=d))
    yield "nanogpt", gpt, lambda m: fuse_blocks(m.transformer.h, m.transformer.ln_f), tokens, tokens

    img = 8 if quick else 32
    vit = hm.VisionTransformer(img_size=img, embed_dim=d, depth=layers, num_heads=heads)
    images = torch.randn(batch, 3, img, img, generator=gen)
    yield "vit", vit, lambda m: fuse_blocks(m.blocks, m.norm), images, torch.randint(0, 10, (batch,), generator=gen)

    lit = hm.LitGPT(hm.LitConfig(n_embd=d, n_head=heads, n_layer=layers, vocab_size=vocab, block_size=seq,
                                 intermediate_size=4 * d))
    yield "litgpt", lit, lambda m: fuse_blocks(m.transformer.h, m.transformer.ln_f,
                                               example=(torch.randn(1, 4, d), m.cos[:4], m.sin[:4])), tokens, tokens

    titan = hm.Transformer(hm.TitanArgs(dim=d, n_layers=layers, n_heads=heads, n_kv_heads=heads // 2,
                                        vocab_size=vocab, max_seq_len=seq))
    yield "torchtitan", titan, lambda m: fuse_blocks(m.layers, m.norm,
                                                     example=(torch.randn(1, 4, d), m.freqs_cis)), tokens, tokens


def _step(model, opt, inputs, targets) -> float:
    t0 = time.perf_counter()
    out = model(inputs)
    logits = out[0] if isinstance(out, tuple) else out
    F.cross_entropy(logits.flatten(0, -2), targets.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def run(args) -> list[dict]:
    steps = 5 if args.quick else 20
    rows = []
    for name, original, fuse, inputs, targets in _styles(args.quick):
        fused = copy.deepcopy(original)
        fuse(fused)
        models = [(m, torch.optim.AdamW(m.parameters(), lr=1e-4)) for m in (original, fused)]
        for m, opt in models:  # warm up
            _step(m, opt, inputs, targets)
        runs = []  # (original, fused) median of each run
        for _ in range(args.repeats):
            times = ([], [])
            for _ in range(steps):
                for (m, opt), ts in zip(models, times, strict=True):
                    ts.append(_step(m, opt, inputs, targets))
            runs.append(tuple(statistics.median(ts) * 1e3 for ts in times))
        ratios = [f / o for o, f in runs]
        rows.append(dict(style=name, original_ms=round(statistics.median(o for o, _ in runs), 3),
                         fused_ms=round(statistics.median(f for _, f in runs), 3),
                         ratio=round(statistics.median(ratios), 3), ratio_min=round(min(ratios), 3),
                         ratio_max=round(max(ratios), 3)))
    return rows
