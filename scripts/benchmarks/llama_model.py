"""The Llama-shaped model of `bench.py gpt-step`: a pre-norm decoder with RMSNorm and a
SwiGLU MLP, its sublayers in one `fuseblock.ResidualStack` (fused=False: the naive stack,
same parameters). Attention is models/gpt.py's `CausalSelfAttention` (no RoPE: the step's
cost at this shape is in the matmuls, attention and norms, which RoPE does not change in
kind); token embeddings only, untied from the head, as Llama's."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fuseblock
from models.gpt import GPT, CausalSelfAttention, GPTConfig


class SwiGLU(nn.Module):
    """w2(silu(x w1) * x w3), w1 and w3 as one Linear (w13) so the fused stream runs the
    block's norm and it as one `norm_linear`."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w13 = nn.Linear(d, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    fuses_prenorm = True  # as models/gpt.py's MLP

    def forward(self, x, residual=None, prenorm=None):  # (B, T, d) -> (B, T, d)
        if prenorm is None:  # x is normed already (the naive stack)
            return self._out(self.w13(x))
        h, residual = prenorm.add_linear(x, residual, self.w13)
        return self._out(h), residual

    def _out(self, h):
        gate, up = h.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, hidden: int,
                 fused: bool, eps: float = 1e-5):
        super().__init__()
        attn = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        mixers = [m for _ in range(n_layer) for m in (CausalSelfAttention(attn), SwiGLU(n_embd, hidden))]
        self.tok = nn.Embedding(vocab_size, n_embd)
        # the residual stream kept in fp32, as models/gpt.py's GPT in scripts/train.py
        self.stack = fuseblock.ResidualStack(mixers, n_embd, kind="rms", eps=eps, final_norm=True, fused=fused,
                                             residual_dtype=torch.float32)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets):  # idx (B, T) int64 -> logits (B, T, vocab), loss
        logits = self.lm_head(self.stack(self.tok(idx)))
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    optimizer_groups = GPT.optimizer_groups  # the same AdamW groups: decay matrices, not norm weights
