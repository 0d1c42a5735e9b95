"""Tensor and sequence parallelism: a ParallelStyle for fuseblock's norms (docs/parallel.md).

`fuseblock.norm`, `add_norm` and the modules take DTensors themselves
(`fuseblock.ops.dtensor`). What torch's own `SequenceParallel` style cannot do is carry the
fused stream's residual: its input hook keeps only the first positional input, so
`AddNorm(x, residual)` would normalize x alone. `SequenceParallel` here shards every
tensor input of a Norm or AddNorm (x, residual, gate; positional or keyword) on the
sequence dim and replicates the module's parameters, whose gradients DTensor then sums
over the ranks. Use it for `blocks.*.norm`, `blocks.*.branch_norm` (sandwich and post-norm
stacks) and `norm_f` of a ResidualStack in a `parallelize_module` plan. `HiddenParallel`
shards a norm on its normalized dim instead, the weight and bias with it: for a norm whose
input comes from a column-parallel Linear (a query/key norm over all heads), with no
gather (fuseblock.ops.dtensor). `FusedColwiseParallel` places the first Linear of a mixer
that fuses the norm into it (`fuses_prenorm`, `Norm.add_linear`): column-parallel weights
and no hooks, since that Linear's forward never runs.
"""
from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from .modules.norm import Norm
from .ops.dtensor import check_strided_split

__all__ = ["FusedColwiseParallel", "HiddenParallel", "SequenceParallel"]


class _NormStyle(ParallelStyle):
    """What both styles share: the tensor arguments of a Norm / AddNorm's calls (positional or
    keyword; through forward, `Norm.add`, `norm_add`, `norm_add_norm` or `add_linear`) made DTensors sharded
    on `_dim(t)`, plain tensors taken as this rank's shard and DTensors placed otherwise
    redistributed; the outputs,
    `out` (Norm), `(out, new_residual)` (AddNorm, norm_add_norm), new_residual (norm_add) or
    `(y, new_residual)` (add_linear: y placed as fuseblock.norm_linear places it),
    DTensors sharded the same way, or their local shards with use_local_output."""

    def __init__(self, *, use_local_output: bool = False):
        super().__init__()
        if type(use_local_output) is not bool:
            raise TypeError(f"use_local_output must be a bool, got {type(use_local_output).__name__}")
        self.use_local_output = use_local_output

    def _dim(self, t: Tensor) -> int:
        raise NotImplementedError

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        """Place the module's parameters (distribute_module replicates those left plain)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = type(self).__name__
        if not isinstance(module, Norm):
            raise TypeError(f"fuseblock.parallel.{style} applies to a fuseblock Norm or AddNorm, "
                            f"got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"{style} takes a 1-D mesh (a 2-D mesh's tensor-parallel dim, mesh['tp']), "
                             f"got {device_mesh.ndim} dims")
        distribute_module(module, device_mesh, self._partition)

        def shard(t):
            if not isinstance(t, Tensor):
                return t
            placements = (Shard(self._dim(t)),)
            if isinstance(t, DTensor):
                return t if t.placements == placements else t.redistribute(device_mesh, placements)
            return DTensor.from_local(t, device_mesh, placements, run_check=False)

        def local(out):
            if isinstance(out, DTensor):
                return out.to_local()
            return tuple(t.to_local() if isinstance(t, DTensor) else t for t in out)

        def sharded(call):
            def run(*args, **kwargs):
                out = call(*(shard(a) for a in args), **{k: shard(v) for k, v in kwargs.items()})
                return local(out) if self.use_local_output else out

            return run

        # The calls the stream makes, wrapped rather than forward (no forward hook would see a
        # call that bypasses it): Norm.add (under forward, and what a block calls), the
        # post-norm and sandwich steps norm_add and norm_add_norm (whose `norm` argument, a
        # Norm, needs this style too: its parameters placed as this one's), and add_linear,
        # a fuses_prenorm mixer's norm and first Linear (fuseblock.norm_linear on DTensors).
        for name in ("add", "norm_add", "norm_add_norm", "add_linear"):
            setattr(module, name, sharded(getattr(module, name)))
        return module


class SequenceParallel(_NormStyle):
    """Shard a fuseblock Norm / AddNorm's inputs (x, residual, gate) on `sequence_dim` and
    replicate its parameters, whose gradients are then Partial sums over the ranks. Plain
    tensor inputs are taken as this rank's rows of the sequence, as torch's
    SequenceParallel takes them."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        super().__init__(use_local_output=use_local_output)
        if type(sequence_dim) is not int:
            raise TypeError(f"sequence_dim must be an int, got {type(sequence_dim).__name__}")
        self.sequence_dim = sequence_dim

    def _dim(self, t: Tensor) -> int:
        if not -t.dim() <= self.sequence_dim < t.dim() or self.sequence_dim % t.dim() == t.dim() - 1:
            raise ValueError(f"sequence_dim {self.sequence_dim} is not a row dim of an input of shape "
                             f"{tuple(t.shape)} (the last dim is the normalized one)")
        return self.sequence_dim % t.dim()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_dim={self.sequence_dim}, use_local_output={self.use_local_output})"


class HiddenParallel(_NormStyle):
    """Shard a fuseblock Norm / AddNorm on its normalized (last) dim: the inputs Shard(-1) (a
    plain tensor is this rank's columns, as a column-parallel Linear's local output is),
    the weight and bias Shard(0). The statistics cost one all-reduce of 8 (RMS) or 16
    (layer) bytes a row forward and as many backward; gates and num_groups > 1 are refused."""

    def _dim(self, t: Tensor) -> int:
        return t.dim() - 1

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _place_parameters(module, mesh, Shard(0), getattr(self, "src_data_rank", 0))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(use_local_output={self.use_local_output})"


class FusedColwiseParallel(ParallelStyle):
    """Column-parallel placement for a Linear that a fuseblock norm fuses (`Norm.add_linear`,
    a `fuses_prenorm` mixer's first Linear): its weight and bias placed `placement`
    (Shard(0); or a strided shard of dim 0, such as q | k | v split by heads), and no hooks.
    Its forward never runs, so torch's ColwiseParallel hooks (the input all-gather, the
    output made local) would be skipped, and add_linear refuses a Linear with hooks. Here
    norm_linear does that work: the norm's style (SequenceParallel) all-gathers the normed
    rows and gives y sharded on its last dim, a DTensor, or its local shard with that
    style's use_local_output."""

    def __init__(self, placement=None):
        super().__init__()
        self.placement = Shard(0) if placement is None else placement
        check_strided_split("FusedColwiseParallel: placement", self.placement)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"fuseblock.parallel.FusedColwiseParallel applies to an nn.Linear, got "
                            f"{type(module).__name__}")

        return distribute_module(module, device_mesh,
                                 lambda name, mod, mesh: _place_parameters(mod, mesh, self.placement,
                                                                           getattr(self, "src_data_rank", 0)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(placement={self.placement!r})"


def _place_parameters(module: nn.Module, mesh: DeviceMesh, placement, src_data_rank) -> None:
    """The module's own parameters made DTensors placed `placement` on `mesh` (from rank
    `src_data_rank`'s values, or None: each rank keeps its own part, as parallelize_module's
    src_data_rank says). torch 2.5 (the floor) has no src_data_rank, and takes rank 0's."""
    source = {} if src_data_rank == 0 else {"src_data_rank": src_data_rank}
    for pname, param in list(module.named_parameters(recurse=False)):
        placed = distribute_tensor(param.detach(), mesh, [placement], **source)
        module.register_parameter(pname, nn.Parameter(placed, requires_grad=param.requires_grad))
