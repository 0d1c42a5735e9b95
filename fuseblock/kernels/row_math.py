"""The row math the norm kernels share (`fuseblock.kernels.norm`, `fuseblock.kernels.norm_wide`,
`fuseblock.kernels.norm_add`): the gate modes and functions, the weight with its offset, the
mean and rstd of a row, the dropout masks (`philox_keep`), the residual and branch scales,
the residual update p (`load_p`), and the backward of one block of rows (`bwd_block`).
Triton functions, inlined where they are called.
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


@triton.jit
def load_p(X, X1, R, RO, SEED, RS, BS, o_x, o_x1, o_r, o_ro, o_e, o_c, mask, alpha, rscale, drop_p, drop_scale,
           HAS_X1: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_R: tl.constexpr, STORE_R: tl.constexpr, R_SCALE: tl.constexpr, BS_VEC: tl.constexpr):
    """p = a * residual + b * (drop(x) + drop(x1)) in fp32 (the plain op: x + residual, alpha
    = 1 being exact), b = alpha or BS[o_c], a (`scale_by`) none, rscale or RS[o_c]; stores
    new_residual and returns its rounded value, so the norm sees exactly what was stored
    (and what the naive stack would add). o_e keys the dropout masks (`philox_keep`);
    drop_scale = 1 / (1 - drop_p)."""
    b_p = tl.load(X + o_x, mask=mask, other=0.0).to(tl.float32)
    if HAS_X1:
        b_x1 = tl.load(X1 + o_x1, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        b_kx, b_kx1 = philox_keep(SEED, o_e, drop_p)
        b_p = tl.where(b_kx, b_p * drop_scale, 0.0)
        if HAS_X1:
            b_x1 = tl.where(b_kx1, b_x1 * drop_scale, 0.0)
    if HAS_X1:
        b_p += b_x1
    if BS_VEC:
        b_p *= tl.load(BS + o_c, mask=mask, other=0.0).to(tl.float32)
    else:
        b_p *= alpha
    if HAS_R:
        b_p += scale_by(tl.load(R + o_r, mask=mask, other=0.0).to(tl.float32), RS, rscale, o_c, mask, R_SCALE)
    if STORE_R:
        b_pr = b_p.to(RO.dtype.element_ty)
        tl.store(RO + o_ro, b_pr, mask=mask)
        b_p = b_pr.to(tl.float32)
    return b_p


@triton.jit
def normalized(b_p, b_g, b_rstd, b_mean, mask, CENTER: tl.constexpr, GATE: tl.constexpr):
    """r = (s - mean) * rstd, s = p * g(z) for a pre-gate, else p (any block shape)."""
    b_s = b_p * b_g if GATE == GATE_PRE else b_p
    return tl.where(mask, b_s - b_mean, 0.0) * b_rstd if CENTER else b_s * b_rstd


@triton.jit
def bwd_block(
    P, Z, DO, DRO, DX, DR, DZ, DX1, SEED, R, X, X1, RS, BS, row, col, mask,
    s_p, s_z, s_do, s_dro, s_dx, s_dr, s_dz, s_r, s_x, s_x1,
    b_w, b_b, b_rstd, b_mean, b_c1, b_c2, D, DG, scale, alpha, rscale, drop_p, drop_scale,
    HAS_X1: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_DRO: tl.constexpr, STORE_DR: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    CENTER: tl.constexpr, GATE: tl.constexpr, ACT: tl.constexpr, WHOLE: tl.constexpr,
    R_SCALE: tl.constexpr, BS_VEC: tl.constexpr,
):
    """The backward of one block of rows (docs/math.md): stores dx (and a separate
    dresidual, dx1 and dz), and returns the block's sums over its rows of dw's and db's
    terms, and of the [d] scales' (dp * residual, dp * (drop(x) + drop(x1)); zeros without).
    The tile kernel's [BR, BG, BD] blocks hold whole groups (WHOLE), whose row constants
    mean(r * dr) and mean(dq) it sums itself; the wide-row column pass's [BR, BD] blocks
    hold a chunk of one group's columns, and get them from bwd_dots as b_c1 and b_c2."""
    if DROPOUT:  # the forward's masks, regenerated first: Philox's temporaries live while little else does
        b_kx, b_kx1 = philox_keep(SEED, row * D + col, drop_p)
    b_p = tl.load(P + row * s_p + col, mask=mask, other=0.0).to(tl.float32)
    b_z = tl.load(Z + row * s_z + col, mask=mask, other=0.0).to(tl.float32) if GATE != GATE_NONE else None
    b_g = gate_act(b_z, ACT) if GATE != GATE_NONE else None
    b_r = normalized(b_p, b_g, b_rstd, b_mean, mask, CENTER, GATE)
    b_do = tl.load(DO + row * s_do + col, mask=mask, other=0.0).to(tl.float32)
    if GATE == GATE_POST:  # dz = do * o1 * g'(z); what reaches o1 is do1 = do * g(z)
        b_o1 = b_r * scale
        if HAS_W:
            b_o1 *= b_w
        if HAS_B:
            b_o1 += b_b
        tl.store(DZ + row * s_dz + col, (b_do * b_o1 * gate_act_grad(b_z, ACT)).to(DZ.dtype.element_ty), mask=mask)
        b_do *= b_g
    b_dr = b_do * scale
    if HAS_W:
        b_dr *= b_w
    # dq = (dr - (r.dr/d) r) / sigma; layer: dp = dq - mean(dq)
    if WHOLE:
        b_c1 = row_mean(tl.sum(b_r * b_dr, 2), DG)[:, :, None]
    b_dq = (b_dr - b_r * b_c1) * b_rstd
    if CENTER:
        if WHOLE:
            b_dq = tl.where(mask, b_dq - row_mean(tl.sum(b_dq, 2), DG)[:, :, None], 0.0)
        else:
            b_dq -= b_c2
    if GATE == GATE_PRE:  # dz = dq * p * g'(z), dp = dq * g(z)
        tl.store(DZ + row * s_dz + col, (b_dq * b_p * gate_act_grad(b_z, ACT)).to(DZ.dtype.element_ty), mask=mask)
        b_dq *= b_g
    if HAS_DRO:  # dp: the norm's part + the gradient arriving at new_residual
        b_dq += tl.load(DRO + row * s_dro + col, mask=mask, other=0.0).to(tl.float32)
    o_c = row * 0 + col  # the columns, of the block's shape: a [d] scale's offsets
    if STORE_DR:  # dresidual = a * dp, apart from dx: in another dtype, or dx is not dp
        tl.store(DR + row * s_dr + col, scale_by(b_dq, RS, rscale, o_c, mask, R_SCALE).to(DR.dtype.element_ty),
                 mask=mask)
    b_srs = tl.sum(b_dq * 0.0, 0)  # the [d] scales' sums: d a = sum dp * r, d b = sum dp * (drop(x) + drop(x1))
    b_sbs = b_srs
    if R_SCALE == SCALE_VEC:
        b_srs = tl.sum(b_dq * tl.load(R + row * s_r + col, mask=mask, other=0.0).to(tl.float32), 0)
    if BS_VEC:
        b_u = tl.load(X + row * s_x + col, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            b_u = tl.where(b_kx, b_u * drop_scale, 0.0)
        if X1 is not None:  # (HAS_X1 is whether dx1 is written apart: with dropout)
            b_u1 = tl.load(X1 + row * s_x1 + col, mask=mask, other=0.0).to(tl.float32)
            b_u += tl.where(b_kx1, b_u1 * drop_scale, 0.0) if DROPOUT else b_u1
        b_sbs = tl.sum(b_dq * b_u, 0)
    # dx = b * keep_x / (1 - drop_p) * dp (b: alpha or the [d] branch scale), dx1 with its
    # own mask (with no dropout dx1 is dx: the caller uses dx for both); the plain op:
    # dx = dp. DX1 is allocated as DX is, contiguous: the same row stride.
    if BS_VEC:
        b_dx = b_dq * tl.load(BS + o_c, mask=mask, other=0.0).to(tl.float32)
    else:
        b_dx = b_dq * alpha
    if DROPOUT:
        b_dx *= drop_scale
        if HAS_X1:
            tl.store(DX1 + row * s_dx + col, tl.where(b_kx1, b_dx, 0.0).to(DX1.dtype.element_ty), mask=mask)
        b_dx = tl.where(b_kx, b_dx, 0.0)
    tl.store(DX + row * s_dx + col, b_dx.to(DX.dtype.element_ty), mask=mask)
    return tl.sum(b_do * b_r, 0) * scale, tl.sum(b_do, 0), b_srs, b_sbs
