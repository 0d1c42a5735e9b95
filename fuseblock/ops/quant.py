"""The scaled fp8 output of `norm` / `add_norm` (quant=...): validation and the call.

The quantized forward is one kernel launch on the Triton path (`fuseblock.kernels.fp8`)
and `fuseblock.fp8.quantize` of the fp32 normed output on the torch path; the two give
the same codes and scales bit for bit. The codes carry no gradient: training goes through
`norm_linear(quant="fp8_row")`, which keeps the forward's row statistics and takes the
gradient at the normed output in high precision.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from .. import fp8, reference
from ..spec import MX_BLOCK, QUANTS, NormSpec, Quant
from .dispatch import kernels, uses_triton

MX_ROUNDINGS = ("floor", "rceil")
QUANT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def with_quant(spec: NormSpec, x: Tensor, *, quant, scale, fp8_dtype, mx_rounding, scale_ub, quant_from,
               mx_columnwise: bool = False) -> NormSpec:
    """spec with validated quantization options; every mistake a ValueError or TypeError
    naming the argument."""
    if not isinstance(quant, str) or quant not in QUANTS:
        raise ValueError(f"quant must be None or one of {sorted(QUANTS)}, got {quant!r}")
    if spec.out_dtype is not None:
        raise ValueError(f"out_dtype and quant={quant!r} both say how the output is stored: pass one (quant_from= "
                         "rounds the normed value to a dtype before it is quantized)")
    mode = QUANTS[quant]
    if fp8_dtype not in fp8.FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
    if x.dtype not in QUANT_DTYPES:
        raise TypeError(f"quant={quant!r} needs x in float16, bfloat16 or float32 (the fp32 normed value is cast), "
                        f"got x of {x.dtype}")
    if not isinstance(mx_rounding, str) or mx_rounding not in MX_ROUNDINGS:
        raise ValueError(f"mx_rounding must be one of {MX_ROUNDINGS}, got {mx_rounding!r}")
    if quant_from is not None and quant_from not in QUANT_DTYPES:
        raise TypeError(f"quant_from must be None or one of {QUANT_DTYPES}, got {quant_from!r}")
    d = x.shape[-1]
    if mode == Quant.MX and (d % MX_BLOCK or (d // spec.groups) % MX_BLOCK):
        raise ValueError(f"quant='mxfp8' needs the last dim (and each of num_groups={spec.groups} groups) to be a "
                         f"multiple of {MX_BLOCK}, got {d}: pad the row to a multiple of {MX_BLOCK}, or use "
                         f"quant='fp8_row'")
    if not isinstance(mx_columnwise, bool):
        raise TypeError(f"mx_columnwise must be a bool, got {type(mx_columnwise).__name__}")
    if mx_columnwise:
        rows = x.numel() // d if d else 0
        if mode != Quant.MX:
            raise ValueError(f"mx_columnwise is mxfp8's columnwise copy; quant={quant!r} has none")
        if rows % MX_BLOCK:
            raise ValueError(f"mx_columnwise needs the number of rows (x.numel() // d = {rows}) to be a multiple of "
                             f"{MX_BLOCK}: its blocks run down the columns; pad the batch or leave it off")
    if mode == Quant.TENSOR:
        check_static_scale(scale, x)
    elif scale is not None:
        raise ValueError(f"scale= is fp8_tensor's static scale; quant={quant!r} computes its own (scale must be None)")
    if scale_ub is not None:
        if mode != Quant.ROW:
            raise ValueError(f"scale_ub bounds fp8_row's amax; it does nothing for quant={quant!r}")
        if isinstance(scale_ub, bool) or not isinstance(scale_ub, (int, float)) or not 0 < scale_ub < math.inf:
            raise ValueError(f"scale_ub must be a positive finite float (an upper bound on each row's amax), "
                             f"got {scale_ub!r}")
    return replace(spec, quant=mode, fp8_e5m2=fp8_dtype == torch.float8_e5m2, mx_rceil=mx_rounding == "rceil",
                   quant_from=quant_from, scale_ub=float(scale_ub or 0.0), mx_columnwise=mx_columnwise)


def check_static_scale(scale, x: Tensor) -> None:
    if not isinstance(scale, Tensor):
        raise TypeError(f"quant='fp8_tensor' needs scale=, a one-element float32 tensor (the static dequantization "
                        f"scale), got {type(scale).__name__}")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(f"scale must be a one-element float32 tensor, got shape {tuple(scale.shape)} {scale.dtype}")
    if scale.device != x.device:
        raise ValueError(f"scale is on {scale.device} but x is on {x.device}")
    if scale.device.type == "cpu" and not (math.isfinite(scale.item()) and scale.item() > 0):
        # a device scale is not read back (no host sync): its value is the caller's to keep positive and finite
        raise ValueError(f"scale must be positive and finite, got {scale.item()}")


# Not a registered custom op yet: torch.compile runs it eagerly, between graphs
@torch.compiler.disable
def quantized_norm_fwd(x: Tensor, residual: Tensor | None, gate: Tensor | None, weight: Tensor | None,
                       bias: Tensor | None, spec: NormSpec, residual_dtype: torch.dtype | None,
                       need_stats: bool, x1: Tensor | None = None, scale: Tensor | None = None):
    """(Quantized, new_residual or None, rstd, mean) with no autograd graph: the kernel
    launch, or the torch path's norm into fp32 (quant_from's dtype when set) and its cast."""
    if spec.dropout_p > 0:
        raise ValueError("quant= does not take add_norm's dropout (dropout_p must be 0)")
    with torch.no_grad():
        if uses_triton(x):
            return kernels("norm", x).norm_fwd(x, residual, gate, weight, bias, spec, residual_dtype, need_stats, x1,
                                               None, qscale=scale)
        plain = replace(spec, quant=Quant.NONE, out_dtype=spec.quant_from or torch.float32)
        out, new_res, rstd, mean = reference.norm_fwd(x, residual, gate, weight, bias, plain, residual_dtype,
                                                      need_stats, x1)
        return fp8.quantize(out, spec, scale), new_res, rstd, mean


@torch.compiler.disable
def quantized_norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias, bspec: NormSpec, spec: NormSpec,
                           alpha: float, residual_dtype: torch.dtype, scale: Tensor | None = None):
    """norm_add_norm's (new_residual, Quantized) with no autograd graph: the second norm's
    output quantized by the kernel's launch, or on the torch path its fp32 output cast."""
    with torch.no_grad():
        if uses_triton(x):
            new_res, q, *_ = kernels("norm_add", x).norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias,
                                                                 bspec, spec, alpha, residual_dtype, True, False, scale)
            return new_res, q
        plain = replace(spec, quant=Quant.NONE, out_dtype=spec.quant_from or torch.float32)
        new_res, out = reference.norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias, bspec, plain,
                                              alpha, residual_dtype, True)
        return new_res, fp8.quantize(out, spec, scale)
