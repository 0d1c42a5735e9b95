"""Tensor and sequence parallelism: a ParallelStyle for fuseblock's norms (docs/parallel.md).

`fuseblock.norm`, `add_norm` and the modules take DTensors themselves
(`fuseblock.ops.dtensor`). What torch's own `SequenceParallel` style cannot do is carry the
fused stream's residual: its input hook keeps only the first positional input, so
`AddNorm(x, residual)` would normalize x alone. `SequenceParallel` here shards every
tensor input of a Norm or AddNorm (x, residual, gate; positional or keyword) on the
sequence dim and replicates the module's parameters, whose gradients DTensor then sums
over the ranks. Use it for `blocks.*.norm` and `norm_f` of a ResidualStack in a
`parallelize_module` plan.
"""
from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from .modules import Norm

__all__ = ["SequenceParallel"]


class SequenceParallel(ParallelStyle):
    """Shard a fuseblock Norm / AddNorm's inputs on `sequence_dim` and replicate its parameters.

    Plain tensor inputs are taken as this rank's shard of the sequence (as torch's
    SequenceParallel takes them); DTensor inputs placed otherwise are redistributed. The
    outputs, `out` (Norm) or `(out, new_residual)` (AddNorm), are DTensors sharded the
    same way, or their local shards with use_local_output=True.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        super().__init__()
        if type(sequence_dim) is not int:
            raise TypeError(f"sequence_dim must be an int, got {type(sequence_dim).__name__}")
        if type(use_local_output) is not bool:
            raise TypeError(f"use_local_output must be a bool, got {type(use_local_output).__name__}")
        self.sequence_dim, self.use_local_output = sequence_dim, use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Norm):
            raise TypeError(f"fuseblock.parallel.SequenceParallel applies to a fuseblock Norm or AddNorm (a "
                            f"stack's blocks.*.norm, norm_f), got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"SequenceParallel takes a 1-D mesh (a 2-D mesh's tensor-parallel dim, "
                             f"mesh['tp']), got {device_mesh.ndim} dims")
        distribute_module(module, device_mesh)  # no partition_fn: parameters replicated
        placements = (Shard(self.sequence_dim),)

        def shard(t):
            if isinstance(t, DTensor):
                return t if t.placements == placements else t.redistribute(device_mesh, placements)
            if isinstance(t, Tensor):
                if not -t.dim() <= self.sequence_dim < t.dim() or self.sequence_dim % t.dim() == t.dim() - 1:
                    raise ValueError(f"sequence_dim {self.sequence_dim} is not a row dim of an input of shape "
                                     f"{tuple(t.shape)} (the last dim is the normalized one)")
                return DTensor.from_local(t, device_mesh, placements, run_check=False)
            return t

        def inputs(_, args, kwargs):
            return tuple(shard(a) for a in args), {k: shard(v) for k, v in kwargs.items()}

        def outputs(_, args, kwargs, out):
            if not self.use_local_output:
                return out
            return tuple(t.to_local() for t in out) if isinstance(out, tuple) else out.to_local()

        module.register_forward_pre_hook(inputs, with_kwargs=True)
        module.register_forward_hook(outputs, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_dim={self.sequence_dim}, use_local_output={self.use_local_output})"

