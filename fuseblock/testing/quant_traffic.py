"""Bytes moved by add_norm with a scaled fp8 output (quant=...), forward: the fused launch
against norm-then-cast.

Byte model: the minimum reads x and residual once and writes new_residual, the fp8 codes
(one byte per element) and the scales once. Unfused, the norm writes out in x's dtype
and a cast reads it back: `naive` charges that cast as torch's eager ops
(`fuseblock.reference.fp8.quantize`, one kernel per op), `naive1` as one ideal kernel that reads
out once and writes the codes and scales. The kernel counts need the Triton interpreter.
"""
from __future__ import annotations

import torch

from .. import add_norm
from ..ops.checks import quant_spec
from ..reference.fp8 import quantize
from ..spec import NormSpec
from .op_traffic import UNCACHED_ARGS, activation_bytes
from .traffic import EagerTraffic, KernelTraffic

QUANT_OPS = ["add_norm+fp8_tensor", "add_norm+fp8_row", "add_norm+mxfp8"]


def measure_quant_traffic(op: str, rows: int, d: int, dtype) -> list[dict]:
    """One forward row for op, one of QUANT_OPS, in the keys of op_traffic's rows."""
    mode = op.split("+")[1]
    torch.manual_seed(0)
    x, residual = (torch.randn(rows, d, dtype=dtype) for _ in range(2))
    w = torch.ones(d, dtype=dtype)
    scale = torch.tensor([0.01]) if mode == "fp8_tensor" else None
    with KernelTraffic(glue=True) as kf:
        q, new_res = add_norm(x, residual, w, quant=mode, scale=scale)
    with KernelTraffic(glue=True) as kn:
        out, _ = add_norm(x, residual, w)
    spec = quant_spec(NormSpec(False, 1.0, 1e-6, 0, 0, 1), x, mode, scale)
    with EagerTraffic() as cast:
        quantize(out, spec, scale)
    scale_bytes = q.scale.nbytes  # fp8_tensor's static scale read, the others' scales written
    mn = x.nbytes + residual.nbytes + new_res.nbytes + q.data.nbytes + scale_bytes
    kernel = kf.bytes + kf.glue_bytes
    unfused = kn.bytes + kn.glue_bytes
    naive_b, naive1 = unfused + cast.bytes, unfused + out.nbytes + q.data.nbytes + scale_bytes
    a = activation_bytes(kf)
    return [dict(
        op=op, dtype=str(dtype).removeprefix("torch."), rows=rows, d=d, pas="fwd",
        kernel_MB=kernel / 1e6, naive_MB=naive_b / 1e6, min_MB=mn / 1e6, other_MB=(kernel - a) / 1e6,
        kernel_over_min=kernel / mn, act_over_min=a / mn,
        uncached_over_min=(kf.accessed(UNCACHED_ARGS | {"QS"}) + kf.glue_bytes) / mn,
        naive_over_kernel=naive_b / kernel, naive1_over_kernel=naive1 / kernel,
        launches=len(kf.launches), glue_ops=len(kf.glue.ops), naive_ops=len(cast.ops) + len(kn.launches),
    )]
