"""Scaled fp8 outputs on the torch path: the casts the kernels fuse, as torch ops.

The norm's output o (fp32, or rounded to `spec.quant_from` first) becomes fp8 codes and
scales (docs/low_precision.md). The conventions, shared with `fuseblock.kernels.fp8`:

- fp8_tensor: codes = sat(o * fp32(1 / scale)), `scale` the caller's static dequantization
  scale (vLLM's static_scaled_fp8_quant; torchao's tensorwise cast with s = 1 / scale).
- fp8_row: s = fp32(fmax / max(amax, 1e-12)) per row (torchao's amax_to_scale; amax bounded
  by scale_ub first when given, vLLM's dynamic per-token quant), codes = sat(o * s), and
  the returned scale is fp32(1 / s) ~ amax / fmax, the dequantization scale _scaled_mm takes.
- mxfp8: blocks of 32 along the row, e8m0 scales: floor (the block amax's exponent minus
  the format's largest power of two) or rceil (the exact ceiling of log2(amax / fmax)),
  codes = sat(o / 2**k), as torchao's to_mx.

sat clamps to +-fmax (448 for e4m3fn, 57344 for e5m2) and keeps NaN; a NaN input makes
NaN codes (and, in mxfp8, a NaN scale) as torchao's casts do.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .spec import MX_BLOCK, NormSpec, Quant

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
AMAX_EPS = 1e-12  # torchao's floor on amax (float8_utils.EPS), compared in fp64
E8M0_BIAS = 127
E8M0_NAN = 255


class Quantized(NamedTuple):
    """A quantized normed output: fp8 `data` of the output's shape and its `scale` (fp32:
    the static scale, or one per row of shape (..., 1); e8m0 of shape (..., d/32) for
    mxfp8). dequantized = data * scale (per block for mxfp8)."""

    data: Tensor
    scale: Tensor
    data_t: Tensor | None = None  # mxfp8's columnwise copy: codes of shape (d, rows), blocks of 32 rows
    scale_t: Tensor | None = None  # and its e8m0 scales, (d, rows/32)


def fp8_dtype(spec: NormSpec) -> torch.dtype:
    return torch.float8_e5m2 if spec.fp8_e5m2 else torch.float8_e4m3fn


def fp8_max(spec: NormSpec) -> float:
    return torch.finfo(fp8_dtype(spec)).max


def max_pow2(spec: NormSpec) -> int:
    """The exponent of the format's largest power of two (torchao's F8E4M3_MAX_POW2...)."""
    return 15 if spec.fp8_e5m2 else 8


def _row_tiny(dtype: torch.dtype) -> tuple[float, float]:
    t = torch.tensor(AMAX_EPS, dtype=torch.float32)
    if t.item() < AMAX_EPS:
        t = torch.nextafter(t, torch.tensor(1.0))
    return t.item(), float(torch.tensor(torch.finfo(dtype).max / AMAX_EPS, dtype=torch.float32))


_ROW_TINY = {dtype: _row_tiny(dtype) for dtype in FP8_DTYPES}  # once: no torch op per call


def row_tiny(spec: NormSpec) -> tuple[float, float]:
    """(t, s_t): an fp32 amax < t is one below AMAX_EPS (t: the least fp32 >= AMAX_EPS), and
    its scale is s_t = fp32(fmax / AMAX_EPS), as torchao's clamp in fp64 gives it."""
    return _ROW_TINY[fp8_dtype(spec)]


def _sat(v: Tensor, spec: NormSpec) -> Tensor:
    m = fp8_max(spec)
    return torch.clamp(v, -m, m).to(fp8_dtype(spec))


def mx_exponents(amax: Tensor, spec: NormSpec) -> Tensor:
    """The biased e8m0 exponent (int32) of blocks with fp32 amax."""
    nan = torch.isnan(amax)
    if spec.mx_rceil:
        descale = amax / fp8_max(spec)
        mant, exp = torch.frexp(descale)  # descale = mant * 2**exp, mant in [0.5, 1)
        k = torch.where(mant == 0.5, exp - 1, exp)  # the exact ceiling of log2(descale)
        k = torch.where(descale == 0, -E8M0_BIAS, k).clamp(-E8M0_BIAS, E8M0_BIAS)
        biased = torch.where(torch.isinf(descale), 254, k + E8M0_BIAS)
    else:
        e = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - max_pow2(spec)
        biased = e.clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    return torch.where(nan, E8M0_NAN, biased).to(torch.int32)


def mx_multiplier(biased: Tensor, spec: NormSpec) -> Tensor:
    """What a block's values are multiplied by before the cast: 1 / 2**k (exact)."""
    if spec.mx_rceil:  # torchao's _to_mx_rceil: exponent 0 multiplies by 1, inf's (254) by 2**-127
        rcp = torch.exp2((E8M0_BIAS - biased).float())
        rcp = torch.where(biased == 254, 2.0 ** -127, rcp)
        return torch.where(biased == 0, 1.0, torch.where(biased == E8M0_NAN, float("nan"), rcp))
    # floor: o / max(2**(biased - 127), 2**-126), a power of two, so a product is the same;
    # a NaN block's scale reads as inf there: its finite values become 0, its NaNs stay
    k = torch.clamp(biased - E8M0_BIAS, min=-126)
    return torch.where(biased == E8M0_NAN, 0.0, torch.exp2((-k).float()))


def quantize(o: Tensor, spec: NormSpec, scale: Tensor | None = None) -> Quantized:
    """The normed output o (any float dtype; cast to fp32 exactly) as codes and scales.
    scale: fp8_tensor's static scale (a one-element fp32 tensor)."""
    o = o.float()
    if spec.quant == Quant.TENSOR:
        return Quantized(_sat(o * torch.reciprocal(scale.float()), spec), scale)
    if spec.quant == Quant.ROW:
        amax = o.abs().amax(-1, keepdim=True) if o.shape[-1] else o.new_zeros(*o.shape[:-1], 1)
        if spec.scale_ub > 0:
            amax = torch.clamp(amax, max=spec.scale_ub)
        s = (fp8_max(spec) / torch.clamp(amax.double(), min=AMAX_EPS)).float()
        return Quantized(_sat(o * s, spec), torch.reciprocal(s))
    data, scale = _mx(o, spec)
    if not spec.mx_columnwise:
        return Quantized(data, scale)
    return Quantized(data, scale, *_mx(o.reshape(-1, o.shape[-1]).t(), spec))


def _mx(o: Tensor, spec: NormSpec) -> tuple[Tensor, Tensor]:
    blocks = o.reshape(*o.shape[:-1], o.shape[-1] // MX_BLOCK, MX_BLOCK)
    biased = mx_exponents(blocks.abs().amax(-1, keepdim=True), spec)
    data = _sat(blocks * mx_multiplier(biased, spec), spec).reshape(o.shape)
    return data, biased.squeeze(-1).to(torch.uint8).view(torch.float8_e8m0fnu)
