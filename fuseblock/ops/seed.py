"""Dropout's randomness: `draw_seed`, the masks' key, shared by the kernels' dropout
(fuseblock.ops.norm; their masks are Philox draws, `fuseblock.kernels.row_math.philox_keep`)
and the DTensor calls' (fuseblock.ops.dtensor), whose masks are `hash_keep`: integer torch
ops hashing the key with each element's global index."""
from __future__ import annotations

import torch
from torch import Tensor
from torch.compiler import is_compiling


def draw_seed(x: Tensor) -> Tensor:
    """The dropout masks' key, one int64 from torch's default generator (torch.manual_seed
    reproduces a call), kept for backward as the only trace of the masks.

    Drawn on the host, from the CPU generator, and passed to the kernel by value: no launch
    on x's device, so the forward is one launch (a draw there would be a second). While a
    CUDA graph is being captured it is drawn on x's device instead, a node of the graph:
    a host draw would run once, at capture, and every replay would reuse its masks, where
    the device generator gives each replay new ones. Compiled code draws on x's device
    too, an op of its graph that Inductor compiles (torch.compile(mode="reduce-overhead")
    records it in its CUDA graph, each replay a new draw; a CPU op would keep the graph out
    of CUDA graphs), and the kernel reads the key from there: a traced launcher has no
    value to read on the host."""
    if is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return torch.randint(0, 2**62, (1,), device=x.device, dtype=torch.int64)
    # device named: under torch.set_default_device("cuda") a bare randint would draw on the GPU
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device="cpu")


# odd multipliers (murmur2's, and one of lowbias32's) below 2**31: times an h below 2**32
# the int64 product cannot overflow, so `(h * m) & _LOW32` is h * m mod 2**32 exactly
_MIX = (0x5BD1E995, 0x7FEB352D)
_LOW32 = 0xFFFFFFFF


def _mix(h: Tensor) -> Tensor:
    """A bijection of [0, 2**32) (xorshift-multiply rounds) whose output bits each depend on
    every input bit. In place on h, a temporary of the caller's: eager, each op is a pass over
    the shard, and fewer allocations save time there (compiled, inductor fuses them)."""
    h.bitwise_xor_(h >> 16).mul_(_MIX[0]).bitwise_and_(_LOW32)
    h.bitwise_xor_(h >> 15).mul_(_MIX[1]).bitwise_and_(_LOW32)
    return h.bitwise_xor_(h >> 16)


def hash_keep(key: Tensor, index: Tensor, dropout_p: float) -> Tensor:
    """Whether each element of global `index` (int64, >= 0) is kept, for the call's `key`
    (int64 in [0, 2**62)): a 32-bit hash of both, kept where it is at least
    round(dropout_p * 2**32). A function of the key and the index alone."""
    h = _mix((index & _LOW32).bitwise_xor_(key & _LOW32))
    h = _mix(h.bitwise_xor_(index >> 32).bitwise_xor_(key >> 32))
    return h >= round(dropout_p * 2**32)
