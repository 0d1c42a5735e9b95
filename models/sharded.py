"""Whole tensors and shards (DTensors: FSDP2's, tensor parallelism's): the one place that tells them apart.

A DTensor can exist only once `torch.distributed.tensor` is imported, so plain models never
import torch.distributed (some torch builds lack it) and pay nothing here.
"""
from __future__ import annotations

import sys

import torch


def is_shard(t) -> bool:
    """Whether t is a DTensor: this rank holds a part of a larger tensor."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` itself, or this rank's part of it laid out as the DTensor `like` is. Every rank
    holds the same `full`, so each cuts its own part and nothing is communicated."""
    if not is_shard(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


@torch.no_grad()
def fill(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor `full` into p, or into p's part of it when p is a shard."""
    p.copy_(shard_like(full, p))


def gather(t: torch.Tensor, keep: bool = True) -> torch.Tensor | None:
    """The whole tensor on the CPU: a shard's parts all-gathered (a collective that every rank
    of its mesh must join, in the same order), a plain tensor as it is. keep=False joins
    the gather and drops the result (the ranks that write nothing)."""
    whole = t.detach().full_tensor() if is_shard(t) else t.detach()
    return whole.cpu() if keep else None
