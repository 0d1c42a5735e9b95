"""Triton helpers that write a norm's fp32 output as scaled fp8 codes (docs/low_precision.md).

The conventions are `fuseblock.reference.fp8`'s (the torch path), value for value. The codes are
made with integer operations on the fp32 bits, never by Triton's fp8 conversion: Triton's
interpreter rounds that conversion wrongly (ties, the carry into the exponent,
subnormals: tests/ops/test_fp8.py shows it), and integer rounding is the same on the
interpreter and on a GPU. Codes are stored as uint8; the launcher views them as fp8.

QUANT takes `fuseblock.spec.Quant`'s values; MBITS/BIAS the fp8 format (e4m3fn: 3, 7;
e5m2: 2, 15); ROUND the rounding of the normed value first (0 none, 1 bf16, 2 fp16).
"""
import math

import torch
import triton
import triton.language as tl

from ..reference import fp8
from ..spec import MX_BLOCK as MX_COLS
from ..spec import Quant
from .launch import nan_max

Q_TENSOR = tl.constexpr(int(Quant.TENSOR))
Q_ROW = tl.constexpr(int(Quant.ROW))
Q_MX = tl.constexpr(int(Quant.MX))
MX_BLOCK = tl.constexpr(32)


@triton.jit
def round_bf16(v):
    """v rounded to bf16 (to nearest, ties to even) and back, by integer operations: the
    interpreter's own conversion truncates. NaN stays NaN."""
    b = v.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return tl.where(v != v, v, r.to(tl.float32, bitcast=True))


@triton.jit
def fp8_codes(v, fmax, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """The fp8 code (uint8) of fp32 v saturated to +-fmax, rounded to nearest even.
    NaN gives the NaN code 0x7F with v's sign, as torch's cast."""
    nan = v != v
    v = tl.minimum(tl.maximum(v, -fmax), fmax)
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    e_in = (a >> 23) - 127
    m = (a & 0x7FFFFF) | 0x800000  # the 24-bit significand
    e = tl.maximum(e_in, 1 - BIAS)  # below the least normal exponent: a subnormal code
    # m >> shift keeps the code's bits; shifts past 25 leave 0 (m < 2**24), so cap them
    shift = tl.minimum(23 - MBITS + (e - e_in), 26)
    q = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    # a significand that rounds up to 2**(MBITS+1) carries into the exponent by the addition
    code = ((e + BIAS) << MBITS) + q - (1 << MBITS)
    code = tl.where(a < 0x800000, 0, code)  # zero and fp32 subnormals: far below the least code
    code = tl.where(nan, 0x7F, code) | (sign << 7)
    return code.to(tl.uint8)


@triton.jit
def pow2(k):
    """2**k as fp32 for integer k in [-127, 127] (2**-127 is subnormal), built from bits."""
    normal = ((k + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(k >= -126, normal, (k * 0 + (1 << 22)).to(tl.float32, bitcast=True))


@triton.jit
def mx_exponent(amax, fmax, MAXPOW2: tl.constexpr, RCEIL: tl.constexpr):
    """The biased e8m0 exponent (int32) of blocks of fp32 amax, and the multiplier of
    their values (1 / their scale; `fuseblock.reference.fp8.mx_exponents`, `mx_multiplier`)."""
    nan = amax != amax
    if RCEIL:
        descale = tl.div_rn(amax, fmax)
        b = descale.to(tl.int32, bitcast=True)
        ex = b >> 23  # amax >= 0: no sign bit
        mant = b & 0x7FFFFF
        # the exact ceiling of log2(descale); subnormal descale: -126 above 2**-127, else less
        k = tl.where(ex == 0, tl.where(mant > (1 << 22), -126, -127), ex - 127 + (mant != 0).to(tl.int32))
        k = tl.minimum(tl.maximum(k, -127), 127)
        biased = tl.where(ex == 255, 254, k + 127)  # inf (NaN is set below)
        mult = tl.where(biased == 0, 1.0, pow2(127 - biased))
        mult = tl.where(biased == 254, pow2(biased * 0 - 127), mult)
        mult = tl.where(nan, descale, mult)
    else:
        ex = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        e = tl.minimum(tl.maximum(ex - 127 - MAXPOW2, -127), 128)
        biased = e + 127
        mult = tl.where(nan, 0.0, pow2(-tl.maximum(e, -126)))
    biased = tl.where(nan, 255, biased)
    return biased, mult


@triton.jit
def store_quantized(O, QS, b_o, o_m, m_m, o_gd, row, mask, s_o, G, DG, fmax, ub, tiny, tiny_scale,
                    QUANT: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, MAXPOW2: tl.constexpr,
                    RCEIL: tl.constexpr, ROUND: tl.constexpr,
                    BR: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
                    OT=None, QST=None, M=0, COLS: tl.constexpr = False):
    """Store the tile kernel's [BR, BG, BD] fp32 output b_o as codes at O (uint8, row
    stride s_o) and its scales at QS: fp8_tensor reads its static scale there, fp8_row
    writes one fp32 per row, mxfp8 one uint8 exponent per 32 columns (row stride G*DG/32)."""
    if ROUND == 1:
        b_o = round_bf16(b_o)
    elif ROUND == 2:
        b_o = b_o.to(tl.float16).to(tl.float32)
    b_o = tl.where(mask, b_o, 0.0)
    col = o_gd[None, :, :]
    if QUANT == Q_TENSOR:
        b_c = fp8_codes(b_o * tl.div_rn(1.0, tl.load(QS)), fmax, MBITS, BIAS)
    elif QUANT == Q_ROW:
        # NaN propagates into the amax and the scale (torchao's, the torch path's), where
        # tl.minimum and tl.maximum drop it on a GPU by default; the constants are broadcast
        # by zeros_like, not amax * 0 (NaN for an infinite amax)
        b_amax = nan_max(nan_max(tl.abs(b_o), 2), 1)  # [BR]
        b_amax = tl.minimum(b_amax, ub, propagate_nan=tl.PropagateNan.ALL)
        b_den = tl.maximum(b_amax, tiny, propagate_nan=tl.PropagateNan.ALL)
        b_s = tl.where(b_amax < tiny, tiny_scale, tl.div_rn(tl.zeros_like(b_amax) + fmax, b_den))
        b_c = fp8_codes(b_o * b_s[:, None, None], fmax, MBITS, BIAS)
        tl.store(QS + o_m, tl.div_rn(tl.zeros_like(b_s) + 1.0, b_s), mask=m_m)
    else:
        NB: tl.constexpr = BD // MX_BLOCK
        b_blk = tl.reshape(b_o, [BR, BG, NB, MX_BLOCK])
        b_amax = nan_max(tl.abs(b_blk), 3)  # [BR, BG, NB]
        b_e, b_mult = mx_exponent(b_amax, fmax, MAXPOW2, RCEIL)
        b_v = b_blk * b_mult[:, :, :, None]
        b_c = fp8_codes(tl.reshape(b_v, [BR, BG, BD]), fmax, MBITS, BIAS)
        o_b = tl.arange(0, NB)
        o_sc = (tl.arange(0, BG)[:, None] * DG + o_b[None, :] * MX_BLOCK) // MX_BLOCK  # [BG, NB]
        m_sc = (tl.arange(0, BG)[:, None] < G) & (o_b[None, :] * MX_BLOCK < DG)
        tl.store(QS + o_m[:, None, None] * (G * DG // MX_BLOCK) + o_sc[None, :, :], b_e.to(tl.uint8),
                 mask=m_sc[None, :, :] & m_m[:, None, None])
        if COLS:  # the columnwise copy: blocks of 32 rows of this program (BR a multiple of 32)
            NR: tl.constexpr = BR // MX_BLOCK
            b_cb = tl.reshape(b_o, [NR, MX_BLOCK, BG, BD])
            b_ce, b_cmult = mx_exponent(nan_max(tl.abs(b_cb), 1), fmax, MAXPOW2, RCEIL)  # [NR, BG, BD]
            b_cc = fp8_codes(tl.reshape(b_cb * b_cmult[:, None, :, :], [BR, BG, BD]), fmax, MBITS, BIAS)
            o_col = o_gd[None, :, :].to(tl.int64)  # int64: column * M passes 2**31 from 2**31 / d rows
            tl.store(OT + o_col * M + row, b_cc, mask=mask)  # data_t[column, row]
            o_rb = ((tl.program_id(0) * BR) // MX_BLOCK + tl.arange(0, NR)).to(tl.int64)
            m_gd = (tl.arange(0, BG)[:, None] < G) & (tl.arange(0, BD)[None, :] < DG)
            tl.store(QST + o_col * (M // MX_BLOCK) + o_rb[:, None, None], b_ce.to(tl.uint8),
                     mask=m_gd[None, :, :] & (o_rb[:, None, None] * MX_BLOCK < M))
    tl.store(O + row * s_o + col, b_c, mask=mask)


# quant_from as store_quantized's ROUND: fp32 (or none) keeps the fp32 value
ROUNDS = {None: 0, torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def quant_buffers(x, spec, qscale):
    """(codes, scales, the kernels' keyword arguments) of a quantized output of x's shape:
    codes uint8; scales qscale itself (fp8_tensor), (..., 1) fp32 (fp8_row) or (..., d/32)
    uint8 exponents (mxfp8)."""
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    lead = x.shape[:-1]
    if spec.quant == Quant.TENSOR:
        qs = qscale
    elif spec.quant == Quant.ROW:
        qs = torch.empty((*lead, 1), dtype=torch.float32, device=x.device)
    else:
        qs = torch.empty((*lead, x.shape[-1] // MX_COLS), dtype=torch.uint8, device=x.device)
    if spec.mx_columnwise:  # (d, rows) codes and (d, rows/32) scales, written by the same launch
        m = x.numel() // x.shape[-1]
        cols = dict(OT=torch.empty((x.shape[-1], m), dtype=torch.uint8, device=x.device),
                    QST=torch.empty((x.shape[-1], m // MX_COLS), dtype=torch.uint8, device=x.device), M=m, COLS=True)
    else:
        cols = {}
    tiny, tiny_scale = fp8.row_tiny(spec)
    kw = dict(QS=qs, q_max=fp8.fp8_max(spec), q_ub=spec.scale_ub if spec.scale_ub > 0 else math.inf,
              q_tiny=tiny, q_tiny_scale=tiny_scale, QUANT=int(spec.quant),
              Q_MBITS=2 if spec.fp8_e5m2 else 3, Q_BIAS=15 if spec.fp8_e5m2 else 7, Q_MAXPOW2=fp8.max_pow2(spec),
              Q_RCEIL=spec.mx_rceil, Q_ROUND=ROUNDS[spec.quant_from], **cols)
    return codes, qs, kw


def quantized(codes, qs, spec, kw=None) -> fp8.Quantized:
    """The launch's buffers as the op returns them: fp8 codes, e8m0 scales for mxfp8 (and
    the columnwise copy from kw, quant_buffers' arguments, when asked)."""
    dtype = fp8.fp8_dtype(spec)
    if spec.quant != Quant.MX:
        return fp8.Quantized(codes.view(dtype), qs)
    if not spec.mx_columnwise:
        return fp8.Quantized(codes.view(dtype), qs.view(torch.float8_e8m0fnu))
    return fp8.Quantized(codes.view(dtype), qs.view(torch.float8_e8m0fnu), kw["OT"].view(dtype),
                         kw["QST"].view(torch.float8_e8m0fnu))
