"""Make Triton's interpreter round narrow floats as a GPU does (for tests; the kernels are untouched).

Why: under TRITON_INTERPRET=1 the interpreter converts fp32 -> bf16 by dropping the low 16
bits. Every such conversion goes through one function, `triton.runtime.interpreter._convert_float`:
`cast_impl` calls it for fp32 <-> bf16 with no rounding mode, and that path is `x.to(tl.bfloat16)`,
`tl.store` of fp32 into a bf16 pointer (the store casts first) and bf16 constants; `create_fp_to_fp`
calls it for every fp8 conversion. Given a rounding mode of "rtne" it adds the half-ulp bit, which
rounds ties away from zero, does not always carry a rounded-up mantissa into the exponent, and
neither saturates nor reliably keeps NaN. A GPU rounds to nearest, ties to even: cvt.rn.bf16.f32 (overflow to inf)
and, for fp8, cvt.rn.satfinite.{e4m3,e5m2}x2 (overflow and inf to the largest finite value, NaN to
NaN). So the interpreter's bf16 results drift from torch's and a GPU's by up to an ulp per
conversion, and more where a truncated value feeds later sums. fp32 -> fp16 needs nothing: the
interpreter converts it with numpy's astype, which rounds to nearest even (overflow to inf) already.

`install()` replaces `_convert_float` with `convert_float`, which rounds to nearest even for every
conversion between the formats in FORMATS and leaves the others (rtz, fp8e4b15, the fnuz fp8s) to
the original. NaN becomes the format's canonical NaN, as on a GPU; fp8 saturates. Checked with
triton 3.1 (the floor) and 3.9, which have that function with one signature; a triton without it
is reported, not patched. tests/conftest.py installs it when TRITON_INTERPRET=1, and so do the
workers the tests start under torchrun (a new process starts unpatched).
"""
from __future__ import annotations

import importlib.util
import inspect
import os
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Format:
    exp_bits: int
    man_bits: int
    has_inf: bool  # False: e4m3fn, whose top exponent holds numbers and, with an all-ones mantissa, NaN
    saturate: bool  # the GPU converts into it with .satfinite

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1

    @property
    def emin(self) -> int:  # the exponent of the smallest normal number
        return 1 - self.bias

    @property
    def width(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def max_finite(self) -> float:
        top = (1 << self.exp_bits) - (2 if self.has_inf else 1)
        spare = 1 if self.has_inf else 2  # e4m3fn gives up its largest mantissa to NaN
        return float(np.ldexp(2.0 - spare * 2.0 ** -self.man_bits, top - self.bias))

    @property
    def nan_bits(self) -> int:  # the canonical NaN a GPU writes: exponent and mantissa all ones
        return (1 << (self.exp_bits + self.man_bits)) - 1


# Keyed by triton's dtype names (tl.dtype.name), the same in triton 3.1 and 3.9.
FORMATS = {
    "fp64": Format(11, 52, True, False),
    "fp32": Format(8, 23, True, False),
    "fp16": Format(5, 10, True, False),
    "bf16": Format(8, 7, True, False),
    "fp8e5": Format(5, 2, True, True),
    "fp8e4nv": Format(4, 3, False, True),
}


def decode(bits: np.ndarray, fmt: Format) -> np.ndarray:
    """The float64 values of `fmt` bit patterns (exact: every format here fits in fp64)."""
    bits = bits.astype(np.int64)
    sign = (bits >> (fmt.exp_bits + fmt.man_bits)) & 1
    exp = (bits >> fmt.man_bits) & ((1 << fmt.exp_bits) - 1)
    man = (bits & ((1 << fmt.man_bits) - 1)).astype(np.float64)
    value = np.where(exp == 0, np.ldexp(man, fmt.emin - fmt.man_bits),
                     np.ldexp(1.0 + np.ldexp(man, -fmt.man_bits), exp - fmt.bias))
    top = exp == (1 << fmt.exp_bits) - 1
    if fmt.has_inf:
        value = np.where(top, np.where(man == 0, np.inf, np.nan), value)
    else:
        value = np.where(top & (man == (1 << fmt.man_bits) - 1), np.nan, value)
    return np.where(sign == 1, -value, value)


def encode(x: np.ndarray, fmt: Format) -> np.ndarray:
    """float64 values rounded to nearest, ties to even, into `fmt` bit patterns (unsigned ints)."""
    with np.errstate(invalid="ignore", over="ignore"):
        a = np.abs(x)
        # The quantum at a's exponent, or at the smallest normal one for subnormal results: scaled
        # by it, a is exact in fp64, and rint rounds to nearest even.
        _, e = np.frexp(a)
        q = np.maximum(e - 1, fmt.emin) - fmt.man_bits
        r = np.ldexp(np.rint(np.ldexp(a, -q)), q)
        r = np.where(r > fmt.max_finite, fmt.max_finite if fmt.saturate else np.inf, r)
        finite = np.isfinite(r)
        rf = np.where(finite, r, 0.0)
        _, e = np.frexp(rf)
        normal = rf >= np.ldexp(1.0, fmt.emin)
        exp = np.where(normal, e - 1 + fmt.bias, 0)
        man = np.where(normal, np.ldexp(rf, -(e - 1)) - 1.0, np.ldexp(rf, -fmt.emin))
        man = np.ldexp(man, fmt.man_bits).astype(np.uint64)
    exp = np.where(finite, exp, (1 << fmt.exp_bits) - 1).astype(np.uint64)
    bits = (np.signbit(x).astype(np.uint64) << np.uint64(fmt.width - 1)) | (exp << np.uint64(fmt.man_bits)) | man
    bits = np.where(np.isnan(x), np.uint64(fmt.nan_bits), bits)
    return bits.astype(getattr(np, f"uint{fmt.width}"))


def fp32_to_bf16(x: np.ndarray) -> np.ndarray:
    """encode(x, bf16) for fp32 x, on the bits (the common case, kept fast): adding 0x7FFF plus
    the last kept bit rounds the low 16 bits to nearest even, carrying into the exponent (and
    to inf) where it must."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(np.isnan(x), np.uint16(FORMATS["bf16"].nan_bits), rounded.astype(np.uint16))


def to_float64(data: np.ndarray, fmt: Format) -> np.ndarray:
    if data.dtype.kind == "f":  # fp16, fp32, fp64 live in numpy's own types
        with np.errstate(invalid="ignore"):  # signalling NaNs
            return data.astype(np.float64)
    return decode(data.view(getattr(np, f"uint{fmt.width}")), fmt)


def make_convert_float(original, rtne):
    """The replacement for interpreter._convert_float: nearest-even for FORMATS, else `original`."""

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        src, dst = FORMATS.get(input_dtype.name), FORMATS.get(output_dtype.name)
        upcast = src is not None and dst is not None and dst.width > src.width
        if src is None or dst is None or not (upcast or rounding_mode is None or rounding_mode == rtne):
            return original(input, input_dtype, output_dtype, rounding_mode)
        data = np.asarray(input)
        if (input_dtype.name, output_dtype.name) == ("bf16", "fp32"):  # every bf16 load the kernels widen: exact
            return data.view(np.uint16).astype(np.uint32) << np.uint32(16)
        if (input_dtype.name, output_dtype.name) == ("fp32", "bf16"):
            return fp32_to_bf16(data)
        return encode(to_float64(data, src), dst).reshape(data.shape)

    convert_float.rounds_like_gpu = True
    return convert_float


def install() -> str | None:
    """Under TRITON_INTERPRET=1, patch this process's interpreter (idempotent; tests/conftest.py
    calls it, and so do the workers that tests start under torchrun). None once it rounds as a
    GPU does or where there is no interpreter to patch (no TRITON_INTERPRET=1, or no triton);
    else why it could not be patched (a triton whose interpreter has no `_convert_float` of the
    known signature): the caller reports it, and the rounding test fails."""
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        return None
    from triton.runtime import interpreter

    original = getattr(interpreter, "_convert_float", None)
    if getattr(original, "rounds_like_gpu", False):
        return None
    params = list(inspect.signature(original).parameters) if callable(original) else None
    if params != ["input", "input_dtype", "output_dtype", "rounding_mode"]:
        return (f"triton.runtime.interpreter._convert_float is {params or 'missing'} in this triton: "
                "its interpreter still truncates fp32 -> bf16 (see fuseblock/testing/interpreter_rounding.py)")
    interpreter._convert_float = make_convert_float(original, interpreter._ir.ROUNDING_MODE.RTNE)
    return None
