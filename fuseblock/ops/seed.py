"""The dropout masks' key: `draw_seed`, shared by the kernels' dropout (fuseblock.ops.norm)
and the DTensor calls' (fuseblock.ops.dtensor)."""
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
