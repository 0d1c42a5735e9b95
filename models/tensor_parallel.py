"""The GPT's tensor-parallel plan: torchtitan's layout on fuseblock's fused residual stream
(docs/parallel.md, "The GPT plan").

On a 1-D mesh of tp ranks (a 2-D mesh's "tp" dim), between sublayers every activation and
the residual are sharded by sequence (Shard(1)): each rank holds T/tp rows of both.

- wte, wpe: row-parallel embeddings (the tables sharded by rows); the lookups' partial sums
  reduce-scattered to the sequence shards. lm_head shares wte's table (tied), sharded the
  same way (Shard(0)), so one parameter serves both.
- Each block's norm and norm_f: fuseblock.parallel.SequenceParallel, which shards x and
  the residual alike (torch's style would keep x alone) and replicates the weight; the
  norm runs on each rank's rows, unchanged.
- Attention: c_attn column-parallel by heads: the normed input all-gathered to T rows, each rank
  holding the q, k and v rows of its n_head / tp heads; attention runs on those heads
  alone. c_proj row-parallel: its partial sums reduce-scattered back to the sequence
  shards. The MLP likewise: c_fc column-parallel, c_proj row-parallel.
- lm_head: column-parallel on the sequence-sharded norm_f output; the logits gathered
  whole on every rank (Replicate), so the loss is the one process's.

A block's norm and its first Linear stay one op, as in one process (fuseblock.norm_linear,
the mixers' fuses_prenorm): on DTensors it normalizes each rank's rows, all-gathers the
normed rows and runs this rank's columns of the Linear on them. In backward it gathers
them again for the weight's gradient, so it keeps this rank's rows alone (the unfused
pair keeps the gathered ones).
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from fuseblock.parallel import FusedColwiseParallel, SequenceParallel

from .gpt import GPT, CausalSelfAttention

__all__ = ["fsdp_placement", "parallelize"]

# c_attn's weight rows are q | k | v, each of n_head heads: rank r holds the r-th part of
# each third, [q_r; k_r; v_r]. DTensor names that layout _StridedShard(0, split_factor=3)
# (the one its own view of a (3, C, C) tensor sharded on dim 1 as (3C, C) takes), so
# full_tensor, distribute_tensor and FSDP2 see the q | k | v order of the checkpoint.
_HEADS = _StridedShard(0, split_factor=3)


def parallelize(model: GPT, mesh: DeviceMesh) -> GPT:
    """Shard `model` (a GPT on the meta device, or one whose weights every rank holds alike)
    over the 1-D `mesh` in place, by the plan above; returns it. Each rank keeps its part
    of its own weights (nothing is sent). n_head and vocab_size must divide by the mesh's
    size. Afterwards the parameters are DTensors: `init_weights()` draws them as one
    process would (each rank keeps its part), and models.checkpoint gathers them whole."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a models.gpt.GPT, got {type(model).__name__}")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"mesh must be a 1-D DeviceMesh (a 2-D mesh's tensor-parallel dim, mesh['tp']), got {mesh}")
    cfg, tp = model.config, mesh.size()
    if cfg.n_head % tp:
        raise ValueError(f"n_head ({cfg.n_head}) must be divisible by the tensor-parallel size ({tp}): each rank "
                         f"computes n_head / tp whole heads")
    if cfg.vocab_size % tp:
        raise ValueError(f"vocab_size ({cfg.vocab_size}) must be divisible by the tensor-parallel size ({tp}): "
                         f"the embedding table and the head are split by rows")
    if not cfg.fused:
        raise ValueError("the tensor-parallel plan runs the fused stream (fused=True): the naive stack's norms "
                         "are not sequence-parallel")
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0), use_local_output=False),
        "stack.norm_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i, block in enumerate(model.stack.blocks):
        attention = isinstance(block.mixer, CausalSelfAttention)
        # the norm and the mixer's first Linear in one (add_linear): the mixer gets its
        # columns of the Linear's output as a plain tensor (its heads' q, k and v), the next
        # block the residual as this rank's rows, which its norm's style takes as Shard(1)
        plan[f"stack.blocks.{i}.norm"] = SequenceParallel(use_local_output=True)
        plan[f"stack.blocks.{i}.mixer.{'c_attn' if attention else 'c_fc'}"] = FusedColwiseParallel(
            _HEADS if attention else Shard(0))
        plan[f"stack.blocks.{i}.mixer.c_proj"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    parallelize_module(model, mesh, plan, src_data_rank=None)
    model.lm_head.weight = model.wte.weight  # tied again: both were placed Shard(0), each on its own
    return model


def fsdp_placement(param: nn.Parameter) -> Shard | None:
    """FSDP2's `shard_placement_fn` for a parallelize()d GPT on a 2-D (dp, tp) mesh: c_attn's
    weight sharded on its input dim (Shard(1)), the rest as FSDP2 does by default (None:
    Shard(0)). c_attn's rows are split by heads on tp already, and FSDP2 splitting those
    rows again makes a layout that no pair of placements describes (DTensor would gather
    it out of order). So c_attn's bias, one dim of such rows, is refused: bias=False."""
    placements = param.placements if isinstance(param, DTensor) else ()
    if _HEADS not in placements:
        return None
    if param.dim() < 2:
        raise ValueError(f"FSDP2 over the tensor-parallel plan takes no c_attn bias (shape {tuple(param.shape)}): "
                         f"its rows are split by heads, and a second split of them has no placement; "
                         f"use bias=False")
    return Shard(1)
