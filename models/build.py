"""The GPT on a run's device: whole, or split over torchrun's ranks (scripts/train.py's --fsdp, --tp)."""
from __future__ import annotations

import warnings

import torch

from .gpt import GPT, GPTConfig
from .settings import SettingsError


def gpt(cfg: GPTConfig, dist) -> GPT:  # dist: train.py's Dist (device, world, dp, tp, fsdp, sharded)
    """The GPT on dist.device, its weights drawn from torch's RNG. Under --fsdp or --tp it
    is built on the meta device (no memory), split over the tensor-parallel ranks
    (models/tensor_parallel.py) and sharded by FSDP2's fully_shard over the data-parallel
    ones, moved to the device empty and initialised there: each rank holds its parts of
    the very model GPT(cfg) draws."""
    if not dist.sharded:
        return GPT(cfg).to(dist.device)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = (init_device_mesh(dist.device.type, (dist.dp, dist.tp), mesh_dim_names=("dp", "tp")) if dist.tp > 1
            else {"dp": init_device_mesh(dist.device.type, (dist.world,))})
    with torch.device("meta"):
        model = GPT(cfg)
    if dist.tp > 1:
        from . import tensor_parallel

        try:
            tensor_parallel.parallelize(model, mesh["tp"])
        except ValueError as e:
            raise SettingsError(f"--tp {dist.tp}: {e}") from None
    if dist.fsdp:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6 has it here only
            from torch.distributed._composable.fsdp import fully_shard

        # FSDP2 warns when a unit returns a view, which an in-place op would cut off from its
        # backward hook: a mixer returns a Linear's output, a view, and the stack never
        # modifies a mixer's output in place
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        placement = {}
        if dist.tp > 1:  # c_attn's weight, split by heads on tp, is sharded on its input dim
            if cfg.n_embd % dist.dp:
                raise SettingsError(f"--fsdp --tp {dist.tp}: n_embd ({cfg.n_embd}) must be divisible by the "
                                    f"{dist.dp} data-parallel ranks, over which c_attn's columns are sharded")
            placement = {"shard_placement_fn": tensor_parallel.fsdp_placement}
        # Each mixer is a unit: nearly all of a sublayer's weights, gathered whole only while it
        # runs. Not its PreNormBlock: the naive stack (--impl naive) runs a block's step without
        # calling the block, past the hooks by which a block unit would gather its norm.
        for block in model.stack.blocks:
            fully_shard(block.mixer, mesh=mesh["dp"], **placement)
        fully_shard(model, mesh=mesh["dp"], **placement)  # the rest: the embeddings (and the tied head), the norms
    model.to_empty(device=dist.device)
    model.init_weights()
    return model
