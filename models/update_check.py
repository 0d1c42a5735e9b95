"""The update check: whether a training step replaced the weights instead of refining them.

A step's relative update is ||w_after - w_before|| / ||w_before||, over all parameters at
once (each tied tensor once). AdamW moves each weight by about the learning rate, so in
training that learns this is small: at most 0.015 in the tiny test model's 300 steps at
the default lr (0.0093 in `make train`'s first 60 steps, the warmup's peak included), and under 1
even at lr 3, 1500 times the default. An lr that ruins a run gives thousands at once: lr
1000 after 10 good steps, 2.4e3. A checkpoint whose weights descend from a step above
LIMIT is suspect: train.py writes it but does not point `latest` at it (docs/gpt.md).

The ratio stays on the device and the largest is kept there too, so the check adds no
sync to a step; `verdict` reads it once per checkpoint.
"""
from __future__ import annotations

import torch

from . import sharded

# A step that moves the weights by more than their own size (see the figures above)
LIMIT = 1.0


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `tensors` together, in fp64; for shards (DTensors) the whole
    tensors', as clip_grad_norm_ takes it (every rank joins). fp64, because an fp32 sum of
    squares overflows to inf from norms of about 1.8e19, which a ruinous step reaches (a step
    at --lr 1e30 moves weights by about 1e30): the ratio is then a finite number, as
    meta.json must record it."""
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]))
    return total.full_tensor() if sharded.is_shard(total) else total


class UpdateCheck:
    """The largest relative update of the steps since the last checkpoint that passed."""

    def __init__(self, model: torch.nn.Module):
        self.params = list(model.parameters())  # a tied tensor once
        device = self.params[0].device
        self.largest = torch.zeros((), device=device)
        self.at = torch.zeros((), dtype=torch.long, device=device)
        self._before: list[torch.Tensor] | None = None

    def before_step(self) -> None:
        self._before = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        before, self._before = self._before, None
        ratio = global_norm([p.detach() - b for p, b in zip(self.params, before, strict=True)]) / global_norm(before)
        worse = ~(ratio <= self.largest)  # a NaN ratio counts as the largest
        self.largest = torch.where(worse, ratio.to(self.largest), self.largest)
        self.at = torch.where(worse, torch.full_like(self.at, step), self.at)

    def verdict(self) -> dict:
        """What meta.json records: the largest ratio, its step, the limit, and whether the
        checkpoint passed. A checkpoint that passed starts the count again; one that did
        not leaves it, so that every later checkpoint is suspect too (their weights
        descend from that step)."""
        largest, at = self.largest.item(), self.at.item()
        passed = largest <= LIMIT
        if passed:
            self.largest.zero_()
            self.at.zero_()
        return {"largest": largest, "step": int(at), "limit": LIMIT, "passed": passed}
