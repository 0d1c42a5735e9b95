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

from ..spec import FP8_DTYPES, MX_BLOCK, NormSpec, Quant

AMAX_EPS = 1e-12  # torchao's floor on amax (float8_utils.EPS), compared in fp64
E8M0_BIAS = 127
E8M0_NAN = 255


class Quantized(NamedTuple):
    """A quantized normed output: fp8 `data` of the output's shape and its `scale` (fp32:
    the static scale, or one per row of shape (..., 1); e8m0 of shape (..., d/32) for
    mxfp8). dequantized = data * scale (per block for mxfp8).

    `anchor`, when an input of the op requires a gradient: the normed output's place in
    the autograd graph. It holds no values (NaN broadcast to the output's shape, in the
    dtype the unquantized op's output has); the gradient given to it, in high precision,
    is the gradient at the normed output, and the op's backward turns it into the same
    dx, dresidual, dweight and dbias as the unquantized op's (docs/low_precision.md).
    A consumer passes it to its own autograd.Function and returns that gradient for it,
    or calls `torch.autograd.backward(q.anchor, grad)`, or uses `dequantize()`."""

    data: Tensor
    scale: Tensor
    data_t: Tensor | None = None  # mxfp8's columnwise copy: codes of shape (d, rows), blocks of 32 rows
    scale_t: Tensor | None = None  # and its e8m0 scales, (d, rows/32)
    anchor: Tensor | None = None

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """data * scale (per block of 32 for mxfp8), formed in fp32 and returned in dtype
        (default: the anchor's, else fp32). With an anchor it is differentiable: its
        gradient passes unchanged to the anchor (the straight-through rule of torchao's
        casts), so `F.linear(q.dequantize(), w)` trains the norm as the unquantized op."""
        if dtype is None:
            dtype = torch.float32 if self.anchor is None else self.anchor.dtype
        elif not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
            raise TypeError(f"dtype must be None or a floating torch.dtype of 16 bits or more, got {dtype!r}")
        if self.anchor is None:
            return dequantize(self.data, self.scale).to(dtype)
        return _Dequantize.apply(self.anchor, self.data, self.scale, dtype)


def dequantize(data: Tensor, scale: Tensor) -> Tensor:
    """fp32 values of fp8 codes and their scales: fp32 scales broadcast (one, or one per
    row), e8m0 scales one per block of 32 along the last dim (255, e8m0's NaN, gives NaN)."""
    if scale.dtype != torch.float8_e8m0fnu:
        return data.float() * scale
    biased = scale.view(torch.uint8).int()
    mult = torch.where(biased == E8M0_NAN, float("nan"), torch.exp2((biased - E8M0_BIAS).float()))
    blocks = data.float().reshape(*data.shape[:-1], data.shape[-1] // MX_BLOCK, MX_BLOCK)
    return (blocks * mult.unsqueeze(-1)).reshape(data.shape)


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, data, scale, dtype):
        ctx.anchor_dtype = anchor.dtype
        return dequantize(data, scale).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.anchor_dtype), None, None, None


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


def div_rn(a: Tensor | float, b: Tensor | float) -> Tensor:
    """a / b rounded once to fp32, as the kernels' tl.div_rn: computed in fp64, whose
    quotient of fp32 operands rounds to the correctly rounded fp32 one, so the torch path
    does not depend on how a device's own fp32 division rounds. One of them a tensor."""
    a, b = (t.double() if isinstance(t, Tensor) else t for t in (a, b))
    return (a / b).float()


def mx_exponents(amax: Tensor, spec: NormSpec) -> Tensor:
    """The biased e8m0 exponent (int32) of blocks with fp32 amax."""
    nan = torch.isnan(amax)
    if spec.mx_rceil:
        descale = div_rn(amax, fp8_max(spec))
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
        return Quantized(_sat(o * div_rn(1.0, scale), spec), scale)
    if spec.quant == Quant.ROW:
        amax = o.abs().amax(-1, keepdim=True) if o.shape[-1] else o.new_zeros(*o.shape[:-1], 1)
        if spec.scale_ub > 0:
            amax = torch.clamp(amax, max=spec.scale_ub)
        s = (fp8_max(spec) / torch.clamp(amax.double(), min=AMAX_EPS)).float()
        return Quantized(_sat(o * s, spec), div_rn(1.0, s))
    data, scale = _mx(o, spec)
    if not spec.mx_columnwise:
        return Quantized(data, scale)
    return Quantized(data, scale, *_mx(o.reshape(-1, o.shape[-1]).t(), spec))


def _mx(o: Tensor, spec: NormSpec) -> tuple[Tensor, Tensor]:
    blocks = o.reshape(*o.shape[:-1], o.shape[-1] // MX_BLOCK, MX_BLOCK)
    biased = mx_exponents(blocks.abs().amax(-1, keepdim=True), spec)
    data = _sat(blocks * mx_multiplier(biased, spec), spec).reshape(o.shape)
    return data, biased.squeeze(-1).to(torch.uint8).view(torch.float8_e8m0fnu)


def blocked_scales(scale: Tensor) -> Tensor:
    """mxfp8 scales (rows, k/32) in the layout torch._scaled_mm takes for block scales
    (cuBLAS's): padded with zeros to whole tiles of 128 rows x 4 scale columns, each tile
    stored as 32 runs of 16: row r of the tile and its 4 scales at run r % 32, position
    4 * (r // 32) + column."""
    rows, cols = scale.shape
    pr, pc = -rows % 128, -cols % 4
    s = torch.nn.functional.pad(scale.view(torch.uint8), (0, pc, 0, pr)) if pr or pc else scale.view(torch.uint8)
    tiles = s.reshape((rows + pr) // 128, 128, (cols + pc) // 4, 4).permute(0, 2, 1, 3)  # (R, C, 128, 4)
    runs = tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1)
    return runs.view(torch.float8_e8m0fnu)


_MM_PROBLEMS: dict[tuple, str | None] = {}  # rowwise_mm_problem's answers, asked once per device and dtypes


def rowwise_mm_problem(device: torch.device, out_dtype: torch.dtype, fp8_dtype: torch.dtype) -> str | None:
    """Why torch._scaled_mm cannot form fp8_row's product (codes of fp8_dtype, y in
    out_dtype) on device, as one line naming the GPU and the dtype; None where it can.
    NVIDIA: rowwise scaling outputs bf16 only before sm_100, bf16 or fp16 from it (fp32
    raises). AMD gfx940 to gfx942 (MI300): their fp8 is float8_e4m3fnuz / e5m2fnuz, and
    fuseblock writes the OCP formats (gfx950 takes those). The CPU takes any."""
    if device.type != "cuda":
        return None
    key = (device, out_dtype, fp8_dtype)
    if key not in _MM_PROBLEMS:
        _MM_PROBLEMS[key] = _rowwise_mm_problem(device, out_dtype, fp8_dtype)
    return _MM_PROBLEMS[key]


def _rowwise_mm_problem(device, out_dtype, fp8_dtype) -> str | None:
    name = torch.cuda.get_device_name(device)
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        if arch in ("gfx940", "gfx941", "gfx942"):
            return (f"{name} ({arch}) multiplies fp8 as float8_e4m3fnuz/float8_e5m2fnuz, and fuseblock writes the "
                    f"OCP {fp8_dtype}: quant='fp8_row' Linear is not supported there (use quant='mxfp8', or none)")
        return None
    major, minor = torch.cuda.get_device_capability(device)
    allowed = (torch.bfloat16,) if major < 10 else (torch.bfloat16, torch.float16)
    if out_dtype not in allowed:
        return (f"torch._scaled_mm's rowwise scaling on {name} (sm_{major}{minor}) outputs "
                f"{' or '.join(str(t) for t in allowed)} only, and y would be {out_dtype}: pass x in bfloat16")
    return None


def mx_block_mm_native(device: torch.device) -> bool:
    """Whether torch._scaled_mm takes mxfp8 block scales on device: CUDA compute
    capability 10.0 and later (B200)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)


def mx_linear(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> Tensor:
    """a @ b^T for mxfp8 operands blocked along their shared last dim k: a (m, k) with
    scales (m, k/32), b (n, k) with (n, k/32). torch._scaled_mm with block scales where
    the device takes them (`mx_block_mm_native`); elsewhere the fallback: both dequantized
    exactly into fp32 (code * 2**e), one fp32 matmul, the result cast to out_dtype."""
    if mx_block_mm_native(a.data.device):
        return torch._scaled_mm(a.data, b.data.t(), scale_a=blocked_scales(a.scale), scale_b=blocked_scales(b.scale),
                                out_dtype=out_dtype)
    return (dequantize(a.data, a.scale) @ dequantize(b.data, b.scale).t()).to(out_dtype)
