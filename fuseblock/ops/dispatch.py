"""Which implementation a call runs: the Triton kernels, or the pure-PyTorch reference.

- CUDA tensors, and CPU tensors under TRITON_INTERPRET=1: the Triton kernels
  (`fuseblock.kernels.<op>`, imported with triton on first use).
- anything else, and float64 everywhere: the torch path (`fuseblock.reference`, a module
  per op family).
- under a torch.func transform: the reference's plain differentiable ops, whatever the
  device (the only thing such a transform can see through).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType

import torch
from torch import Tensor

from ..triton_support import kernel_module

# The Triton interpreter is chosen when triton is imported, so this is fixed per process.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_cpu_kernels = False  # set by `kernels_on_cpu`
# INTERPRET or inside `kernels_on_cpu`: kernels_take_cpu() as a flag, for the hot path to read
# as `dispatch.CPU_KERNELS` (no call)
CPU_KERNELS = INTERPRET


def kernels_take_cpu() -> bool:
    """Whether CPU tensors go to the Triton kernels (the interpreter, or `kernels_on_cpu`)."""
    return INTERPRET or _cpu_kernels


def uses_triton(x: Tensor) -> bool:
    """Whether a call on `x` runs the Triton kernels (else the pure-PyTorch path)."""
    return x.dtype != torch.float64 and (x.is_cuda or (kernels_take_cpu() and x.device.type == "cpu"))


# The kernel modules loaded so far, by op: `kernels` fills it, and the hot path reads it
# (`LOADED["norm"]`, no call) where kernels() would be a call on every launch.
LOADED: dict[str, ModuleType] = {}


def kernels(op: str, x: Tensor) -> ModuleType:
    """The Triton launchers of `op` (`fuseblock.kernels.<op>`: "norm", "norm_add", "embed_norm",
    "channel_norm", "hyper", "attn_res") for a call on `x`, loaded once."""
    try:
        return LOADED[op]
    except KeyError:
        module = LOADED[op] = kernel_module(op, x.device)
        return module


@contextlib.contextmanager
def kernels_on_cpu() -> Iterator[None]:
    """Send CPU tensors to the Triton launchers without the interpreter, for tools that
    intercept the launches rather than run them (`bench.py sm90` compiles what the
    launchers pick for an H100 on a machine with no GPU)."""
    global _cpu_kernels, CPU_KERNELS
    before, _cpu_kernels, CPU_KERNELS = _cpu_kernels, True, True
    try:
        yield
    finally:
        _cpu_kernels, CPU_KERNELS = before, INTERPRET or before


# func_transforms_active(): whether a torch.func transform (vmap, grad, jvp, ...) is tracing
# this call. torch's own check, called directly (what torch's Function.apply asks): on every call.
func_transforms_active = torch._C._are_functorch_transforms_active
