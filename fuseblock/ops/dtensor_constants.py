"""What Dynamo takes as constants of a traced DTensor call (`torch.compiler.assume_constant_result`):
C++ state it cannot read. fuseblock.ops.dtensor imports this on a DTensor call, not at import:
the decorator imports torch._dynamo, which `import fuseblock` does not."""
import torch


@torch.compiler.assume_constant_result  # Dynamo cannot trace the C++ flag's read: a constant of the trace
def implicit_replication() -> bool:
    """Whether torch's implicit_replication() context is active (DTensor's dispatcher flag)."""
    from torch.distributed.tensor import DTensor

    return bool(getattr(DTensor._op_dispatcher, "_allow_implicit_replication", False))


@torch.compiler.assume_constant_result  # Dynamo cannot read the attribute of this C++ placement
def split_factor(p) -> int:
    return p.split_factor
