"""The row math the norm kernels share (`fuseblock.kernels.norm`, `fuseblock.kernels.norm_add`):
the gate modes and functions, the weight with its offset, the mean and rstd of a row, and
the dropout masks (`philox_keep`). Triton functions, inlined where they are called.
"""
# No `from __future__ import annotations`: Triton 3.1's interpreter reads the string
# "tl.constexpr" as no annotation and passes BR, BD, ... as arrays (tests/tools/test_floor.py).

import triton
import triton.language as tl

from ..spec import Act, Gate

# The modes of fuseblock.spec as kernel constants (launchers pass int(spec.gate) etc.).
GATE_NONE = tl.constexpr(int(Gate.NONE))
GATE_PRE = tl.constexpr(int(Gate.PRE))
GATE_POST = tl.constexpr(int(Gate.POST))
ACT_UNUSED = tl.constexpr(int(Act.UNUSED))
ACT_IDENTITY = tl.constexpr(int(Act.IDENTITY))
ACT_SIGMOID = tl.constexpr(int(Act.SIGMOID))
ACT_SILU = tl.constexpr(int(Act.SILU))


@triton.jit
def check_modes(GATE: tl.constexpr, ACT: tl.constexpr):
    """An unknown mode fails to compile, never runs as a silent identity."""
    tl.static_assert(GATE == GATE_NONE or GATE == GATE_PRE or GATE == GATE_POST, "unknown GATE mode")
    tl.static_assert((GATE == GATE_NONE and ACT == ACT_UNUSED)
                     or (GATE != GATE_NONE and (ACT == ACT_IDENTITY or ACT == ACT_SIGMOID or ACT == ACT_SILU)),
                     "unknown ACT for this GATE")


@triton.jit
def gate_act(z, ACT: tl.constexpr):
    """The gate function g(z)."""
    if ACT == ACT_SIGMOID:
        z = tl.sigmoid(z)
    elif ACT == ACT_SILU:
        z = z * tl.sigmoid(z)
    return z


@triton.jit
def gate_act_grad(z, ACT: tl.constexpr):
    """g'(z) for the gate functions of `gate_act`."""
    s = tl.sigmoid(z)
    if ACT == ACT_SIGMOID:
        d = s * (1.0 - s)
    elif ACT == ACT_SILU:
        d = s * (1.0 + z * (1.0 - s))
    else:
        d = s * 0.0 + 1.0
    return d


@triton.jit
def row_weight(W, o_w, m_w, woff):
    """woff + w in fp32 (Gemma's 1 + w): the sum is never rounded to the weight's dtype."""
    return tl.load(W + o_w, mask=m_w, other=0.0).to(tl.float32) + woff


@triton.jit
def row_mean(b_sum, DG):
    # IEEE division: the default GPU division is approximate (2 ulp), and that error
    # is multiplied by rstd, which is huge for (near-)constant rows such as d = 1.
    return tl.div_rn(b_sum, tl.cast(DG, tl.float32))


@triton.jit
def row_rstd(b_ss, DG, eps, EXACT_SQ: tl.constexpr):
    """1 / sqrt(b_ss / DG + eps) from a sum of squares. EXACT_SQ (eps = 0): b_ss was summed in
    fp64, where no fp32 value's square underflows or overflows, so rows of any scale
    normalize to unit size; with eps > 0, eps sets the floor and fp32 suffices."""
    if EXACT_SQ:
        b_r = (1.0 / tl.sqrt(b_ss / DG)).to(tl.float32)
    else:
        b_r = tl.rsqrt(row_mean(b_ss, DG) + eps)
    return b_r


@triton.jit
def sq_prod(b_a, b_b, EXACT_SQ: tl.constexpr):
    """b_a * b_b for a sum of squares: in fp64 when EXACT_SQ (see row_rstd)."""
    if EXACT_SQ:
        b_a = b_a.to(tl.float64)
        b_b = b_b.to(tl.float64)
    return b_a * b_b


@triton.jit
def philox_keep(SEED, o_e, drop_p):
    """The dropout masks (True: kept) of x and of x1 at the elements o_e = row * d + column:
    two of the four independent streams of one Philox draw keyed by the call's seed. Keyed
    by the element, not by its address or program, so the backward (any layout) regenerates
    exactly the forward's masks and nothing is stored. SEED is the seed itself (an int64
    drawn on the host: no launch to make it) or a pointer to it (drawn on the device while
    a CUDA graph is captured); each is its own compiled variant."""
    if SEED.dtype.is_ptr():
        key = tl.load(SEED)
    else:
        # The key per element (o_e >= 0 always): a scalar key lets the compiler hoist
        # Philox's 20 round keys out of the persistent loop, live throughout it. Compiled
        # for sm_90 (bf16, layer, x1), the tile backward then spilled 888 bytes a thread at
        # d = 1000, against 80 this way (48 with the seed loaded, as before).
        key = tl.where(o_e >= 0, SEED, 0)
    b_u0, b_u1, _, _ = tl.rand4x(key, o_e)
    return b_u0 >= drop_p, b_u1 >= drop_p



# A residual or branch scale of the residual update r' = a * r + b * branch (docs/math.md):
# none, one float (a scalar argument), or a [d] vector in memory; launchers pass `scale_mode`
SCALE_NONE = tl.constexpr(0)
SCALE_FLOAT = tl.constexpr(1)
SCALE_VEC = tl.constexpr(2)


def scale_mode(value: float, vector) -> int:
    """The constexpr mode of a scale: its [d] tensor (vector), else its float (1: none)."""
    return 2 if vector is not None else int(value != 1.0)


@triton.jit
def scale_by(b, S, s, o_c, mask, MODE: tl.constexpr):
    """b times the scale, in fp32: b (MODE none), b * s (float), b * S[o_c] (vector; o_c the
    columns, of b's shape)."""
    if MODE == SCALE_FLOAT:
        b = b * s
    elif MODE == SCALE_VEC:
        b = b * tl.load(S + o_c, mask=mask, other=0.0).to(tl.float32)
    return b
