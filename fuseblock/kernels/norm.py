"""Triton kernels for the fused residual-add + normalize (+ gate) op, forward and backward.

Two layouts, picked per call by the width of one normalized group:
- `tile`: a [BR rows, BG groups, BD columns] block holds whole rows in registers, many
  rows per program. Used when a row fits (BG * BD <= MAX_TILE_FWD / MAX_TILE_BWD).
- wide rows, which do not fit in registers (forward: a group wider than MAX_TILE_FWD;
  backward: wider than MAX_TILE_BWD): the forward loops over column chunks of one row at
  a time (`_fwd_loop`); the backward takes two launches, the per-row constants
  (`_bwd_dots`) then a column-chunk pass (`_bwd_cols`).

Launches: one forward; a backward of at most two, and no torch op around them (the
parameters' gradients are written in their own dtypes, by a kernel). The layout rule,
the stride contract and the partial-row sums are `fuseblock.kernels.launch`'s, shared
with the other kernel modules.

Names: i_ program ids, o_ offsets, m_ masks, b_ blocks (fp32 in registers). Tensors:
X input, X1 add_norm's second branch, SEED its dropout masks' key, R residual, Z gate,
W weight, B bias, O output, RO new_residual, P the saved p; a D prefix is a gradient.
GATE and ACT take the named modes of `fuseblock.spec`.
Statistics (rstd, mean) are fp32 whatever the storage dtype.

Traffic (tile kernels): forward reads x, x1, residual, gate once and writes out,
new_residual once. Backward reads the saved p (new_residual or x), gate, dout and the
gradient arriving at new_residual once, and writes dx (which is also the residual's
gradient unless alpha != 1 or dropout), dx1 (with dropout), dgate once. Dropout masks
are regenerated from SEED, never stored (`philox_keep`). dw and db are reduced per program in registers and written as
one fp32 partial row per program, which a second launch (`_bwd_sum`) adds up and
stores in the parameters' dtypes; `_bwd_cols` sums them itself, in the last program of
each column chunk to finish. A single program writes dw and db directly. Wide rows read
p (and dout, in the backward) twice: docs/performance.md counts it.
"""
# No `from __future__ import annotations`: Triton 3.1's interpreter reads the string
# "tl.constexpr" as no annotation and passes BR, BD, ... as arrays (tests/tools/test_floor.py).

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ..reference import fp8
from ..spec import Gate, NormSpec, Quant
from . import launch, occupancy
from .fp8 import quant_buffers, quantized, store_quantized
from .launch import (
    LAUNCHES,
    Layout,
    bwd_layout,
    cdiv,
    fit_per_sm,
    fwd_layout,
    loop_layout,
    num_sms,
    out_arg,
    pow2,
    row_arg,
    row_programs,
    sum_partial_rows,
    sum_rows,
    vec,
    warps,
)
from .occupancy import learn, programs_per_sm
from .row_math import (
    GATE_NONE,
    GATE_POST,
    GATE_PRE,
    SCALE_VEC,
    check_modes,
    gate_act,
    gate_act_grad,
    philox_keep,
    row_mean,
    row_rstd,
    row_weight,
    scale_by,
    scale_mode,
    sq_prod,
)

# whether torch.use_deterministic_algorithms(True) is on: launch.deterministic()'s answer, torch's
# own C call, once a backward (a plan's key)
_deterministic = torch._C._get_deterministic_algorithms

# The wide-row backward's column pass (read at call time, as launch.py's constants)
COLS_BLOCK = 2048  # columns per program of the column-chunk kernel
COLS_TILE = 8192  # and elements per [rows, columns] block it loads
# With dropout the column pass also regenerates two masks a block: at 8192 elements it needed
# 255 registers and 8 bytes of stack a thread on sm_100; at 4096, 214 and none (sm_90, sm_100)
COLS_TILE_DROPOUT = 4096
# ... and launches with launch.NO_SPILL: left to itself ptxas capped the stream-K column pass at
# 128 registers (sm_90, bf16) to fit two programs an SM and spilled 8 bytes; uncapped it takes
# 200 (one program, as before the split). The other variants fit two, or one, without it.
# programs per SM before occupancy is learned: as many as an SM's threads allow; what fits is
# 1 to 2 on sm_90 (118 to 146 registers x 256 threads), 3 on gfx942 (bench.py targets)
COLS_PROGRAMS_PER_SM = 8
# mxfp8 down the columns too: the tile kernel takes 32 rows a program (whole scale blocks down
# each column) and transposes them, up to this many elements. Compiled for sm_90 and sm_100,
# 32 rows of 256 took 201 to 217 registers and no stack in 4 warps; of 512, 64 to 744 bytes
# of stack in 8 or 16 warps; of 1024, 312 to 15056 (up to MAX_TILE_FWD, as before). Wider
# rows are normed by the plain kernel and quantized by `fuseblock.reference.fp8.quantize`.
MX_COLUMNWISE_TILE = 8192
MIN_ROWS_PER_PROGRAM = 64  # keeps dw/db partial rows (fp32, written and summed) near 3% of bf16 traffic


# --------------------------------------------------------------------------- helpers
@triton.jit
def _load_p(X, X1, R, RO, SEED, RS, BS, o_x, o_x1, o_r, o_ro, o_e, o_c, mask, alpha, rscale, drop_p, drop_scale,
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


# --------------------------------------------------------------------------- forward
@triton.jit(do_not_specialize=["M", "eps", "scale", "woff", "alpha", "rscale", "drop_p", "drop_scale", "SEED",
                               "q_ub"])
def _fwd_tile(
    X, X1, R, Z, W, B, O, RO, RSTD, MEAN, SEED, RS, BS,
    s_x, s_x1, s_r, s_z, s_o, s_ro,
    M, G, DG, eps, scale, woff, alpha, rscale, drop_p, drop_scale,
    BR: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
    FLAGS: tl.constexpr,  # `fwd_flags`: HAS_X1 ... EXACT_SQ, GATE and ACT in one constexpr
    # the scaled fp8 output (`fuseblock.kernels.fp8.store_quantized`): O holds its codes
    QS=None, q_max=0.0, q_ub=0.0, q_tiny=0.0, q_tiny_scale=0.0,
    QUANT: tl.constexpr = 0, Q_MBITS: tl.constexpr = 3, Q_BIAS: tl.constexpr = 7, Q_MAXPOW2: tl.constexpr = 8,
    Q_RCEIL: tl.constexpr = False, Q_ROUND: tl.constexpr = 0, OT=None, QST=None, M_T=0, COLS: tl.constexpr = False,
):
    HAS_X1: tl.constexpr = FLAGS & 1  # each a constexpr, as FLAGS is: branches resolved at compile time
    DROPOUT: tl.constexpr = (FLAGS >> 1) & 1
    HAS_R: tl.constexpr = (FLAGS >> 2) & 1
    STORE_R: tl.constexpr = (FLAGS >> 3) & 1
    HAS_W: tl.constexpr = (FLAGS >> 4) & 1
    HAS_B: tl.constexpr = (FLAGS >> 5) & 1
    CENTER: tl.constexpr = (FLAGS >> 6) & 1
    STORE_STATS: tl.constexpr = (FLAGS >> 7) & 1
    EXACT_SQ: tl.constexpr = (FLAGS >> 8) & 1
    GATE: tl.constexpr = (FLAGS >> 9) & 3
    ACT: tl.constexpr = (FLAGS >> 11) & 3
    R_SCALE: tl.constexpr = (FLAGS >> 13) & 3
    BS_VEC: tl.constexpr = (FLAGS >> 15) & 1
    check_modes(GATE, ACT)
    i_m = tl.program_id(0)
    o_m = (i_m * BR + tl.arange(0, BR)).to(tl.int64)  # int64: M * stride may pass 2**31
    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    m_gd = (o_g[:, None] < G) & (o_d[None, :] < DG)  # [BG, BD]
    o_gd = o_g[:, None] * DG + o_d[None, :]  # column within the row
    m_m = o_m < M
    mask = m_m[:, None, None] & m_gd[None, :, :]
    row = o_m[:, None, None]
    col = o_gd[None, :, :]

    b_p = _load_p(X, X1, R, RO, SEED, RS, BS, row * s_x + col, row * s_x1 + col, row * s_r + col, row * s_ro + col,
                  row * (G * DG) + col, row * 0 + col, mask, alpha, rscale, drop_p, drop_scale, HAS_X1, DROPOUT,
                  HAS_R, STORE_R, R_SCALE, BS_VEC)
    if GATE == GATE_PRE:
        b_s = b_p * gate_act(tl.load(Z + row * s_z + col, mask=mask, other=0.0).to(tl.float32), ACT)
    else:
        b_s = b_p
    if CENTER:
        # Centre on each group's first element before summing: a constant group is then
        # exactly its value (q = 0, out = bias), where the fp32 mean's remainder would be
        # amplified by rstd ~ 1/sqrt(eps). It also cancels less on offset rows.
        b_shift = tl.sum(tl.where(o_d[None, None, :] == 0, b_s, 0.0), 2)  # [BR, BG]
        b_c = tl.where(mask, b_s - b_shift[:, :, None], 0.0)
        b_dmean = row_mean(tl.sum(b_c, 2), DG)
        b_mean = b_shift + b_dmean
        b_q = tl.where(mask, b_c - b_dmean[:, :, None], 0.0)
    else:
        b_q = b_s
    b_rstd = row_rstd(tl.sum(sq_prod(b_q, b_q, EXACT_SQ), 2), DG, eps, EXACT_SQ)
    b_o = b_q * (b_rstd[:, :, None] * scale)
    if HAS_W:
        b_o *= row_weight(W, o_gd, m_gd, woff)[None, :, :]
    if HAS_B:
        b_o += tl.load(B + o_gd, mask=m_gd, other=0.0).to(tl.float32)[None, :, :]
    if GATE == GATE_POST:  # loaded only now: held through the row sums, it spilled (rows of 32768)
        b_o *= gate_act(tl.load(Z + row * s_z + col, mask=mask, other=0.0).to(tl.float32), ACT)
    if QUANT == 0:
        tl.store(O + row * s_o + col, b_o.to(O.dtype.element_ty), mask=mask)
    else:
        store_quantized(O, QS, b_o, o_m, m_m, o_gd, row, mask, s_o, G, DG, q_max, q_ub, q_tiny, q_tiny_scale,
                        QUANT, Q_MBITS, Q_BIAS, Q_MAXPOW2, Q_RCEIL, Q_ROUND, BR, BG, BD, OT, QST, M_T, COLS)
    if STORE_STATS:
        o_stat = o_m[:, None] * G + o_g[None, :]
        m_stat = m_m[:, None] & (o_g[None, :] < G)
        tl.store(RSTD + o_stat, b_rstd, mask=m_stat)
        if CENTER:
            tl.store(MEAN + o_stat, b_mean, mask=m_stat)


@triton.jit(do_not_specialize=["MG", "eps", "scale", "woff", "alpha", "rscale", "drop_p", "drop_scale", "SEED"])
def _fwd_loop(
    X, X1, R, Z, W, B, O, RO, RSTD, MEAN, SEED, RS, BS,
    s_x, s_x1, s_r, s_z, s_o, s_ro,
    MG, G, DG, eps, scale, woff, alpha, rscale, drop_p, drop_scale,
    BD: tl.constexpr,
    HAS_X1: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_R: tl.constexpr, STORE_R: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    CENTER: tl.constexpr, GATE: tl.constexpr, ACT: tl.constexpr, STORE_STATS: tl.constexpr,
    EXACT_SQ: tl.constexpr, R_SCALE: tl.constexpr, BS_VEC: tl.constexpr,
):
    check_modes(GATE, ACT)
    # Persistent: program i_p handles (row, group) pairs i_p, i_p + n_p, ... A row this
    # wide does not fit on chip, so it is read twice, never three times: pass 1 reads the
    # inputs, writes new_residual and gathers the statistics in one sweep; pass 2 reads
    # p back and writes out. With a residual or x1, pass 2 reads new_residual (one tensor,
    # just written) rather than x and residual or x1 again (two).
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_d = tl.arange(0, BD)
    for i_it in range(i_p, MG, n_p):
        i_mg = tl.cast(i_it, tl.int64)
        i_m = i_mg // G
        o_base = (i_mg % G) * DG  # first column of this group
        # per lane: element count, running mean, and the sum of squares (RMS) or of
        # squared deviations from that mean (Welford: no sum-of-squares cancellation)
        b_n = tl.zeros([BD], dtype=tl.float32)
        b_mu = tl.zeros([BD], dtype=tl.float32)
        if EXACT_SQ:
            b_sq = tl.zeros([BD], dtype=tl.float64)
        else:
            b_sq = tl.zeros([BD], dtype=tl.float32)
        for i_d in range(0, DG, BD):
            o_col = o_base + i_d + o_d
            m_d = i_d + o_d < DG
            b_s = _load_p(X, X1, R, RO, SEED, RS, BS, i_m * s_x + o_col, i_m * s_x1 + o_col, i_m * s_r + o_col,
                          i_m * s_ro + o_col, i_m * (G * DG) + o_col, o_col, m_d, alpha, rscale, drop_p, drop_scale,
                          HAS_X1, DROPOUT, HAS_R, STORE_R, R_SCALE, BS_VEC)
            if GATE == GATE_PRE:
                b_s *= gate_act(tl.load(Z + i_m * s_z + o_col, mask=m_d, other=0.0).to(tl.float32), ACT)
            if CENTER:
                b_n += tl.where(m_d, 1.0, 0.0)
                b_delta = tl.where(m_d, b_s - b_mu, 0.0)
                b_mu += b_delta / tl.maximum(b_n, 1.0)
                b_sq += sq_prod(b_delta, b_s - b_mu, EXACT_SQ)
            else:
                b_sq += sq_prod(b_s, b_s, EXACT_SQ)
        if CENTER:  # merge the lanes (Chan et al.): M2 = sum M2_j + sum n_j (mu_j - mean)^2
            # relative to lane 0's mean: a constant row's lane means all equal it, so its
            # mean is exact and q = 0 (out = bias), as in the tile kernel
            b_mu0 = tl.sum(tl.where(o_d == 0, b_mu, 0.0), 0)
            b_mean = b_mu0 + row_mean(tl.sum(b_n * (b_mu - b_mu0), 0), DG)
            b_dev = b_mu - b_mean
            b_rstd = row_rstd(tl.sum(b_sq, 0) + tl.sum(sq_prod(b_n * b_dev, b_dev, EXACT_SQ), 0), DG, eps, EXACT_SQ)
        else:
            b_rstd = row_rstd(tl.sum(b_sq, 0), DG, eps, EXACT_SQ)
        for i_d in range(0, DG, BD):
            o_col = o_base + i_d + o_d
            m_d = i_d + o_d < DG
            if STORE_R and (HAS_R or HAS_X1):
                b_s = tl.load(RO + i_m * s_ro + o_col, mask=m_d, other=0.0).to(tl.float32)
            else:  # x alone (its dropout mask regenerated): read x again, the same bytes as new_residual
                b_s = _load_p(X, X1, R, RO, SEED, RS, BS, i_m * s_x + o_col, i_m * s_x1 + o_col, i_m * s_r + o_col,
                              i_m * s_ro + o_col, i_m * (G * DG) + o_col, o_col, m_d, alpha, rscale, drop_p,
                              drop_scale, HAS_X1, DROPOUT, HAS_R, False, R_SCALE, BS_VEC)
                if STORE_R:  # new_residual is (alpha times) x in another dtype: the norm sees the rounded value
                    b_s = b_s.to(RO.dtype.element_ty).to(tl.float32)
            if GATE != GATE_NONE:
                b_g = gate_act(tl.load(Z + i_m * s_z + o_col, mask=m_d, other=0.0).to(tl.float32), ACT)
            if GATE == GATE_PRE:
                b_s *= b_g
            b_q = b_s - b_mean if CENTER else b_s
            b_o = b_q * (b_rstd * scale)
            if HAS_W:
                b_o *= row_weight(W, o_col, m_d, woff)
            if HAS_B:
                b_o += tl.load(B + o_col, mask=m_d, other=0.0).to(tl.float32)
            if GATE == GATE_POST:
                b_o *= b_g
            tl.store(O + i_m * s_o + o_col, b_o.to(O.dtype.element_ty), mask=m_d)
        if STORE_STATS:
            tl.store(RSTD + i_mg, b_rstd)
            if CENTER:
                tl.store(MEAN + i_mg, b_mean)


# --------------------------------------------------------------------------- backward
@triton.jit
def _normalized(b_p, b_g, b_rstd, b_mean, mask, CENTER: tl.constexpr, GATE: tl.constexpr):
    """r = (s - mean) * rstd, s = p * g(z) for a pre-gate, else p (any block shape)."""
    b_s = b_p * b_g if GATE == GATE_PRE else b_p
    return tl.where(mask, b_s - b_mean, 0.0) * b_rstd if CENTER else b_s * b_rstd


@triton.jit
def _bwd_block(
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
    hold a chunk of one group's columns, and get them from _bwd_dots as b_c1 and b_c2."""
    if DROPOUT:  # the forward's masks, regenerated first: Philox's temporaries live while little else does
        b_kx, b_kx1 = philox_keep(SEED, row * D + col, drop_p)
    b_p = tl.load(P + row * s_p + col, mask=mask, other=0.0).to(tl.float32)
    b_z = tl.load(Z + row * s_z + col, mask=mask, other=0.0).to(tl.float32) if GATE != GATE_NONE else None
    b_g = gate_act(b_z, ACT) if GATE != GATE_NONE else None
    b_r = _normalized(b_p, b_g, b_rstd, b_mean, mask, CENTER, GATE)
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


@triton.jit(do_not_specialize=["M", "scale", "woff", "alpha", "rscale", "drop_p", "drop_scale", "SEED"])
def _bwd_tile(
    P, Z, W, B, RSTD, MEAN, DO, DRO, DX, DR, DZ, DWP, DBP, DX1, SEED, R, X, X1, RS, BS, DRSP, DBSP,
    s_p, s_z, s_do, s_dro, s_dx, s_dr, s_dz, s_r, s_x, s_x1,
    M, G, DG, scale, woff, alpha, rscale, drop_p, drop_scale,
    BR: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
    FLAGS: tl.constexpr,  # `bwd_flags`: HAS_X1 ... HAS_B, CENTER, GATE and ACT in one constexpr
):
    HAS_X1: tl.constexpr = FLAGS & 1  # constexprs, as in _fwd_tile
    DROPOUT: tl.constexpr = (FLAGS >> 1) & 1
    HAS_DRO: tl.constexpr = (FLAGS >> 2) & 1
    STORE_DR: tl.constexpr = (FLAGS >> 3) & 1
    HAS_W: tl.constexpr = (FLAGS >> 4) & 1
    HAS_B: tl.constexpr = (FLAGS >> 5) & 1
    CENTER: tl.constexpr = (FLAGS >> 6) & 1
    GATE: tl.constexpr = (FLAGS >> 9) & 3
    ACT: tl.constexpr = (FLAGS >> 11) & 3
    R_SCALE: tl.constexpr = (FLAGS >> 13) & 3
    BS_VEC: tl.constexpr = (FLAGS >> 15) & 1
    check_modes(GATE, ACT)
    # A persistent grid: program i_p handles row blocks i_p, i_p + n_p, ... and keeps
    # its dw/db sums in registers, so it writes one partial row (fp32) at the very end:
    # row i_p of DWP/DBP, which `_bwd_sum` adds up. A grid of one program writes dw and
    # db themselves, in the parameters' dtype (DWP/DBP are then dw and db).
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    m_gd = (o_g[:, None] < G) & (o_d[None, :] < DG)
    o_gd = o_g[:, None] * DG + o_d[None, :]
    b_w = row_weight(W, o_gd, m_gd, woff)[None, :, :] if HAS_W else None
    b_b = tl.load(B + o_gd, mask=m_gd, other=0.0).to(tl.float32)[None, :, :] if HAS_B else None
    b_dw = tl.zeros([BG, BD], dtype=tl.float32)
    b_db = tl.zeros([BG, BD], dtype=tl.float32)
    b_drs = tl.zeros([BG, BD], dtype=tl.float32)  # the [d] scales' sums, as dw's
    b_dbs = tl.zeros([BG, BD], dtype=tl.float32)
    for i_m in range(i_p, tl.cdiv(M, BR), n_p):
        o_m = (i_m * BR + tl.arange(0, BR)).to(tl.int64)
        m_m = o_m < M
        o_stat = o_m[:, None] * G + o_g[None, :]
        m_stat = m_m[:, None] & (o_g[None, :] < G)
        b_rstd = tl.load(RSTD + o_stat, mask=m_stat, other=0.0)[:, :, None]
        b_mean = tl.load(MEAN + o_stat, mask=m_stat, other=0.0)[:, :, None] if CENTER else None
        b_sw, b_sb, b_srs, b_sbs = _bwd_block(
            P, Z, DO, DRO, DX, DR, DZ, DX1, SEED, R, X, X1, RS, BS, o_m[:, None, None], o_gd[None, :, :],
            m_m[:, None, None] & m_gd[None, :, :], s_p, s_z, s_do, s_dro, s_dx, s_dr, s_dz, s_r, s_x, s_x1,
            b_w, b_b, b_rstd, b_mean, None, None, G * DG, DG, scale, alpha, rscale, drop_p, drop_scale,
            HAS_X1, DROPOUT, HAS_DRO, STORE_DR, HAS_W, HAS_B, CENTER, GATE, ACT, True, R_SCALE, BS_VEC)
        b_dw += b_sw
        b_db += b_sb
        b_drs += b_srs
        b_dbs += b_sbs
    o_part = i_p.to(tl.int64) * G * DG + o_gd
    if HAS_W:
        tl.store(DWP + o_part, b_dw.to(DWP.dtype.element_ty), mask=m_gd)
    if HAS_B:
        tl.store(DBP + o_part, b_db.to(DBP.dtype.element_ty), mask=m_gd)
    if R_SCALE == SCALE_VEC:
        tl.store(DRSP + o_part, b_drs.to(DRSP.dtype.element_ty), mask=m_gd)
    if BS_VEC:
        tl.store(DBSP + o_part, b_dbs.to(DBSP.dtype.element_ty), mask=m_gd)


@triton.jit(do_not_specialize=["MG", "scale", "woff"])
def _bwd_dots(
    P, Z, W, RSTD, MEAN, DO, DOT, CNT,
    s_p, s_z, s_do,
    MG, G, DG, scale, woff, n_cnt,
    BD: tl.constexpr,
    HAS_W: tl.constexpr, CENTER: tl.constexpr, GATE: tl.constexpr, ACT: tl.constexpr, ZERO_CNT: tl.constexpr,
):
    check_modes(GATE, ACT)
    # Wide rows, step 1 of 2: the per-(row, group) constants of dq, which need the whole
    # row before any dx can be written. DOT[mg] = (mean(r * dr), mean(dq)).
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_d = tl.arange(0, BD)
    if ZERO_CNT:  # and the n_cnt arrival counters of _bwd_cols, which runs next: no launch of their own
        for i_c in range(i_p * BD, n_cnt, n_p * BD):
            tl.store(CNT + i_c + o_d, tl.zeros([BD], dtype=tl.int32), mask=i_c + o_d < n_cnt)
    for i_mg in range(i_p, MG, n_p):
        i_m = (i_mg // G).to(tl.int64)
        o_base = (i_mg % G) * DG
        b_rstd = tl.load(RSTD + i_mg)
        b_mean = tl.load(MEAN + i_mg) if CENTER else None
        b_c1 = tl.zeros([BD], dtype=tl.float32)  # sum r * dr
        b_c2 = tl.zeros([BD], dtype=tl.float32)  # sum dr
        b_c3 = tl.zeros([BD], dtype=tl.float32)  # sum r
        for i_d in range(0, DG, BD):
            o_col = o_base + i_d + o_d
            m_d = i_d + o_d < DG
            b_p = tl.load(P + i_m * s_p + o_col, mask=m_d, other=0.0).to(tl.float32)
            b_do = tl.load(DO + i_m * s_do + o_col, mask=m_d, other=0.0).to(tl.float32)
            b_g = None
            if GATE != GATE_NONE:
                b_g = gate_act(tl.load(Z + i_m * s_z + o_col, mask=m_d, other=0.0).to(tl.float32), ACT)
            b_r = _normalized(b_p, b_g, b_rstd, b_mean, m_d, CENTER, GATE)
            if GATE == GATE_POST:
                b_do *= b_g
            b_dr = b_do * scale
            if HAS_W:
                b_dr *= row_weight(W, o_col, m_d, woff)
            b_c1 += b_r * b_dr
            b_c2 += b_dr
            b_c3 += b_r
        c1 = row_mean(tl.sum(b_c1, 0), DG)
        tl.store(DOT + 2 * i_mg, c1)
        if CENTER:  # mean of dq = rstd * (mean(dr) - c1 * mean(r)); mean(r) is 0 up to rounding
            tl.store(DOT + 2 * i_mg + 1, (row_mean(tl.sum(b_c2, 0), DG) - c1 * row_mean(tl.sum(b_c3, 0), DG)) * b_rstd)


@triton.jit
def _store_sums(DW, DB, o_col, m_d, b_dw, b_db, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """A column chunk's dw and db, in the parameters' dtypes, from the one program that summed all its rows."""
    if HAS_W:
        tl.store(DW + o_col, b_dw.to(DW.dtype.element_ty), mask=m_d)
    if HAS_B:
        tl.store(DB + o_col, b_db.to(DB.dtype.element_ty), mask=m_d)


@triton.jit(do_not_specialize=["M", "scale", "woff", "alpha", "rscale", "drop_p", "drop_scale", "SEED"])
def _bwd_cols(
    P, Z, W, B, RSTD, MEAN, DOT, DO, DRO, DX, DR, DZ, DWP, DBP, DX1, SEED, R, X, X1, RS, BS, DRSP, DBSP, DW, DB,
    DRS, DBS, CNT,
    s_p, s_z, s_do, s_dro, s_dx, s_dr, s_dz, s_r, s_x, s_x1,
    M, G, DG, scale, woff, alpha, rscale, drop_p, drop_scale,
    BR: tl.constexpr, BD: tl.constexpr,
    HAS_X1: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_DRO: tl.constexpr, STORE_DR: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    SUM_PARTS: tl.constexpr,
    CENTER: tl.constexpr, GATE: tl.constexpr, ACT: tl.constexpr, R_SCALE: tl.constexpr, BS_VEC: tl.constexpr,
):
    RS_VEC: tl.constexpr = R_SCALE == SCALE_VEC  # the [d] scales' sums go as dw's and db's, through the same slots
    check_modes(GATE, ACT)
    # Wide rows, step 2 of 2, split stream-K: the work is n_t items, (column chunk i_c
    # inside one group, row block i_m) chunk-major, and program i_p takes the items
    # [i_p * n_t // n_p, (i_p + 1) * n_t // n_p): a whole wave of programs whatever the
    # chunk count, each within one item of the others. With the row constants from
    # _bwd_dots, dx needs only its own columns; and walking down a chunk's rows keeps
    # dw/db in registers, so a program writes one row of sums per chunk it touches (a
    # row-major loop would read and write its partial row for every row it handles).
    # One flat loop over the items, the chunk's columns worked out (and its weight loaded,
    # from L1/L2) per item: a loop over chunks around one over row blocks took up to 49
    # more registers (sm_90, rms bf16: 167 where this takes 124), and 2 programs an SM no
    # longer fitted.
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    n_cg = tl.cdiv(DG, BD)  # chunks per group
    n_b = tl.cdiv(M, BR)  # row blocks: the items of one chunk
    n_t = tl.cast(G * n_cg, tl.int64) * n_b  # (i_p + 1) * n_t may pass 2^31; n_t (< M * d / 2048) does not
    t_lo = tl.cast(i_p * n_t // n_p, tl.int32)
    t_hi = tl.cast((i_p + 1) * n_t // n_p, tl.int32)  # > t_lo: the launcher takes no more programs than items
    o_d = tl.arange(0, BD)
    b_dw = tl.zeros([BD], dtype=tl.float32)
    b_db = tl.zeros([BD], dtype=tl.float32)
    b_drs = tl.zeros([BD], dtype=tl.float32)
    b_dbs = tl.zeros([BD], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        i_c = t // n_b
        i_m = t - i_c * n_b
        i_g = i_c // n_cg
        o_in = (i_c % n_cg) * BD + o_d  # columns within the group
        m_d = o_in < DG
        o_col = i_g * DG + o_in
        b_w = row_weight(W, o_col, m_d, woff)[None, :] if HAS_W else None
        b_b = tl.load(B + o_col, mask=m_d, other=0.0).to(tl.float32)[None, :] if HAS_B else None
        o_m = (i_m * BR + tl.arange(0, BR)).to(tl.int64)
        m_m = o_m < M
        o_mg = o_m * G + i_g
        b_rstd = tl.load(RSTD + o_mg, mask=m_m, other=0.0)[:, None]
        b_mean = tl.load(MEAN + o_mg, mask=m_m, other=0.0)[:, None] if CENTER else None
        b_c1 = tl.load(DOT + 2 * o_mg, mask=m_m, other=0.0)[:, None]
        b_c2 = tl.load(DOT + 2 * o_mg + 1, mask=m_m, other=0.0)[:, None] if CENTER else None
        b_sw, b_sb, b_srs, b_sbs = _bwd_block(
            P, Z, DO, DRO, DX, DR, DZ, DX1, SEED, R, X, X1, RS, BS, o_m[:, None], o_col[None, :],
            m_m[:, None] & m_d[None, :], s_p, s_z, s_do, s_dro, s_dx, s_dr, s_dz, s_r, s_x, s_x1, b_w, b_b,
            b_rstd, b_mean, b_c1, b_c2, G * DG, DG, scale, alpha, rscale, drop_p, drop_scale,
            HAS_X1, DROPOUT, HAS_DRO, STORE_DR, HAS_W, HAS_B, CENTER, GATE, ACT, False, R_SCALE, BS_VEC)
        b_dw += b_sw
        b_db += b_sb
        b_drs += b_srs
        b_dbs += b_sbs
        if (i_m == n_b - 1) | (t == t_hi - 1):  # the chunk's last item, or this program's
            if not SUM_PARTS:  # no chunk is shared (the launcher knows): these sums are dw and db
                _store_sums(DW, DB, o_col, m_d, b_dw, b_db, HAS_W, HAS_B)
                _store_sums(DRS, DBS, o_col, m_d, b_drs, b_dbs, RS_VEC, BS_VEC)
            elif (t_lo <= t - i_m) & (t - i_m + n_b <= t_hi):  # all of the chunk's rows were this program's
                _store_sums(DW, DB, o_col, m_d, b_dw, b_db, HAS_W, HAS_B)
                _store_sums(DRS, DBS, o_col, m_d, b_drs, b_dbs, RS_VEC, BS_VEC)
            else:
                # A chunk shared by programs p_lo .. p_hi: each writes its row of sums (fp32)
                # to slot i_p + i_c of DWP/DBP, rows of BD. Along the items (p, c) only ever
                # steps up, so p + c names each (program, chunk) pair once, n_p + chunks - 1
                # rows in all, and the chunk's sharers hold slots p_lo + i_c .. p_hi + i_c.
                o_slot = tl.cast(i_p + i_c, tl.int64) * BD + o_d
                if HAS_W:
                    tl.store(DWP + o_slot, b_dw, mask=m_d)
                if HAS_B:
                    tl.store(DBP + o_slot, b_db, mask=m_d)
                if RS_VEC:
                    tl.store(DRSP + o_slot, b_drs, mask=m_d)
                if BS_VEC:
                    tl.store(DBSP + o_slot, b_dbs, mask=m_d)
            b_dw = tl.zeros([BD], dtype=tl.float32)
            b_db = tl.zeros([BD], dtype=tl.float32)
            b_drs = tl.zeros([BD], dtype=tl.float32)
            b_dbs = tl.zeros([BD], dtype=tl.float32)
    if SUM_PARTS:
        # Only a program's first and last chunks can be shared. For each that is, the program
        # counts itself in on the chunk's counter (zeroed by _bwd_dots) once all its rows are
        # written (here, after the loop: the sums' registers stay out of it), and the last of
        # the chunk's p_hi - p_lo + 1 sharers to arrive sums their rows into dw and db: no
        # third launch. Memory order: the barrier makes every thread's partial stores precede
        # (in the CTA) the one thread that does the atomic; its release (acq_rel, GPU scope)
        # publishes them, being cumulative, before the count can be seen. The last sharer's
        # acquire (the same atomic) then sees every earlier sharer's release, so all their
        # rows are visible to it; the result reaches the other threads through shared memory
        # and a barrier (how Triton hands out a scalar atomic's value), which orders their
        # loads after that acquire (and sum_rows loads through L2, past this SM's L1).
        tl.debug_barrier()
        c_first = t_lo // n_b
        c_last = (t_hi - 1) // n_b
        for i_c in range(c_first, c_last + 1, tl.maximum(c_last - c_first, 1)):  # c_first, then c_last
            t_c = i_c * n_b  # the chunk's first item
            if (t_c < t_lo) | (t_hi < t_c + n_b):
                n_before = tl.atomic_add(CNT + i_c, 1, sem="acq_rel", scope="gpu")
                # the owners of the chunk's first and last items (item t's: the last p with p * n_t // n_p <= t)
                p_lo = ((t_c + 1) * tl.cast(n_p, tl.int64) - 1) // n_t
                p_hi = ((t_c + n_b) * tl.cast(n_p, tl.int64) - 1) // n_t
                if n_before == p_hi - p_lo:
                    o_first = (p_lo + i_c) * BD  # the sharers' first slot
                    o_start = (i_c // n_cg) * DG + (i_c % n_cg) * BD  # the chunk's first column
                    m_d = (i_c % n_cg) * BD + o_d < DG
                    if HAS_W:
                        sum_rows(DWP + o_first, DW + o_start, p_hi - p_lo + 1, BD, o_d, m_d, BR, BD)
                    if HAS_B:
                        sum_rows(DBP + o_first, DB + o_start, p_hi - p_lo + 1, BD, o_d, m_d, BR, BD)
                    if RS_VEC:
                        sum_rows(DRSP + o_first, DRS + o_start, p_hi - p_lo + 1, BD, o_d, m_d, BR, BD)
                    if BS_VEC:
                        sum_rows(DBSP + o_first, DBS + o_start, p_hi - p_lo + 1, BD, o_d, m_d, BR, BD)


# --------------------------------------------------------------------------- launchers
def _branch(spec: NormSpec) -> tuple[float, float, float, float]:
    """(alpha, rscale, drop_p, drop_scale) of add_norm's branch, as the kernels take them."""
    p = spec.dropout_p
    return spec.alpha, spec.residual_scale, p, (1.0 / (1.0 - p) if p > 0 else 1.0)


def _fwd_layout(d: int, spec: NormSpec):
    """The forward's layout for spec: the variants whose widest tile spills most take the
    loop kernel sooner (launch.MAX_TILE_FWD_HEAVY)."""
    return fwd_layout(d, spec.groups, heavy=spec.dropout_p > 0 or spec.gate == Gate.PRE or spec.groups > 1)


def _quantized_fwd(x, residual, gate, weight, bias, spec, residual_dtype, need_stats, x1, seed, qscale):
    d = x.shape[-1]
    M = x.numel() // d if d else 0
    lay = _fwd_layout(d, spec) if M > 0 else None
    if lay is not None and (not lay.tile or (spec.mx_columnwise and 32 * lay.bg * lay.bd > MX_COLUMNWISE_TILE)):
        plain = replace(spec, quant=Quant.NONE, mx_columnwise=False, out_dtype=spec.quant_from or torch.float32)
        out, new_res, rstd, mean = norm_fwd(x, residual, gate, weight, bias, plain, residual_dtype, need_stats, x1,
                                            seed)
        return fp8.quantize(out, spec, qscale), new_res, rstd, mean
    codes, qs, quant = quant_buffers(x, spec, qscale)
    if spec.mx_columnwise:  # 32 rows per program at least: whole blocks down the columns
        quant["M_T"] = quant.pop("M")
    _, new_res, rstd, mean = norm_fwd(x, residual, gate, weight, bias, spec, residual_dtype, need_stats, x1, seed,
                                      _codes=codes, _quant=quant)
    return quantized(codes, qs, spec, quant), new_res, rstd, mean


# Forward launches of contiguous tensors, laid out once per static signature (the spec's serial, x's
# shape and dtype, which tensors come in which dtypes, and the layout constants, read at call
# time as `launch.layout` reads them): (spec, grid, out's dtype, the statistics' shape, the
# row strides and scalars, the constexprs), or (spec, None) where the tile does not take
# the call (the loop kernel, which learns its occupancy from its first launch; no rows).
_FWD_PLANS: dict = {}


def _fwd_plan(x, residual, gate, weight, bias, spec: NormSpec, residual_dtype, need_stats, x1, seed, rscale,
              bscale) -> tuple:
    d = x.shape[-1]
    M, G = x.numel() // d, spec.groups
    lay = _fwd_layout(d, spec) if M > 0 else None
    if lay is None or not lay.tile:
        return spec, None
    # contiguous rows: every row stride is d; 0 for an absent tensor (never read)
    strides = (d, 0 if x1 is None else d, 0 if residual is None else d, 0 if gate is None else d, d,
               0 if residual_dtype is None else d)  # s_x, s_x1, s_r, s_z, s_o, s_ro
    scalars = (*strides, M, G, d // G, spec.eps, spec.scale, spec.weight_offset, *_branch(spec))
    flags = _fwd_flags(x1, residual, weight, bias, spec, residual_dtype is not None, need_stats, rscale, bscale)
    consts = dict(BR=lay.br, BG=lay.bg, BD=lay.bd, num_warps=lay.warps, FLAGS=fold_flags(flags))
    return spec, (cdiv(M, lay.br),), spec.out_dtype_for(x.dtype), (M, G), scalars, consts


# Where each flag sits in the tile kernels' one FLAGS constexpr (GATE and ACT two bits each):
# one argument for Triton's launcher to bind and key, on every launch, instead of eleven
_FLAG_BITS = dict(HAS_X1=0, DROPOUT=1, HAS_R=2, HAS_DRO=2, STORE_R=3, STORE_DR=3, HAS_W=4, HAS_B=5, CENTER=6,
                  STORE_STATS=7, EXACT_SQ=8, GATE=9, ACT=11, R_SCALE=13, BS_VEC=15)


def fold_flags(flags: dict) -> int:
    """`_fwd_flags` or `_bwd_flags` as the tile kernels' FLAGS (their first lines unfold it)."""
    folded = 0
    for name, value in flags.items():
        folded |= int(value) << _FLAG_BITS[name]
    return folded


def _fwd_flags(x1, residual, weight, bias, spec: NormSpec, store_r: bool, need_stats: bool, rscale=None,
               bscale=None) -> dict:
    """The forward kernels' constexpr flags (num_warps apart), by name: the loop kernel takes
    them so, the tile kernel folded (`fold_flags`). rscale, bscale: the [d] scales or None."""
    return dict(HAS_X1=x1 is not None, DROPOUT=spec.dropout_p > 0, HAS_R=residual is not None, STORE_R=store_r,
                HAS_W=weight is not None, HAS_B=bias is not None, CENTER=spec.center, GATE=int(spec.gate),
                ACT=int(spec.act), STORE_STATS=need_stats, EXACT_SQ=spec.eps == 0,
                R_SCALE=scale_mode(spec.residual_scale, rscale), BS_VEC=bscale is not None)


@launch.on_device(0)
def norm_fwd(x, residual, gate, weight, bias, spec: NormSpec, residual_dtype, need_stats, x1=None, seed=None,
             out=None, new_res=None, qscale=None, _codes=None, _quant=None, rscale=None, bscale=None):
    """Triton forward, same contract as `fuseblock.reference.norm.norm_fwd`. x1 and seed (the
    dropout masks' key, drawn by the caller when spec.dropout_p > 0: an int, or a one-element
    int64 tensor on x's device that the kernel reads) are add_norm's branch:
    p = residual + alpha * (drop(x) + drop(x1)). out and new_res: (M, d) tensors to write
    into (of x's and residual_dtype), for `fuseblock.serve`, which may pass x and the
    residual themselves; else they are allocated. rscale, bscale: the [d] residual and
    branch scales (p = rscale * residual + bscale * (...)), or None.

    With spec.quant, out is `fuseblock.reference.fp8.Quantized` (qscale: fp8_tensor's static scale),
    written by the tile kernel in its one launch. Rows too wide for a tile are normed into
    fp32 by the loop kernel and cast by `fuseblock.reference.fp8.quantize` (two passes more)."""
    if x.is_cuda and x.get_device() != torch._C._cuda_getDevice():  # launch.on_device
        return launch.on_its_device(norm_fwd, x, locals())
    if spec.quant != Quant.NONE and _codes is None:
        return _quantized_fwd(x, residual, gate, weight, bias, spec, residual_dtype, need_stats, x1, seed, qscale)
    if (out is None and _codes is None and spec.serial is not None and not launch.TRACING.on and x.is_contiguous()
            and (residual is None or residual.is_contiguous())
            and (weight is None or weight.is_contiguous()) and (bias is None or bias.is_contiguous())
            and (gate is None or gate.is_contiguous()) and (x1 is None or x1.is_contiguous())
            and (rscale is None or rscale.is_contiguous()) and (bscale is None or bscale.is_contiguous())):
        key = (spec.serial, x.shape, x.dtype, x.device, residual_dtype, need_stats,
               None if residual is None else residual.dtype, None if gate is None else gate.dtype,
               None if weight is None else weight.dtype, None if bias is None else bias.dtype,
               None if x1 is None else x1.dtype, seed.__class__, launch.MAX_TILE_FWD, launch.MAX_TILE_FWD_HEAVY,
               launch.MAX_ROWS, launch.WARP, launch.SM_THREADS, rscale is None, bscale is None)
        try:
            plan = _FWD_PLANS[key]
        except KeyError:
            plan = None
        if plan is None:
            plan = _fwd_plan(x, residual, gate, weight, bias, spec, residual_dtype, need_stats, x1, seed, rscale,
                             bscale)
            if len(_FWD_PLANS) >= 4096:
                _FWD_PLANS.clear()
            _FWD_PLANS[key] = plan
        if plan[1] is not None:
            _, grid, out_dtype, stat_shape, scalars, consts = plan
            dev = x.device
            out = torch.empty(x.shape, dtype=out_dtype, device=dev)
            new_res = torch.empty(x.shape, dtype=residual_dtype, device=dev) if residual_dtype is not None else None
            rstd = torch.empty(stat_shape, dtype=torch.float32, device=dev) if need_stats else None
            mean = torch.empty(stat_shape, dtype=torch.float32, device=dev) if need_stats and spec.center else None
            _fwd_tile[grid](x, x1, residual, gate, weight, bias, out, new_res, rstd, mean, seed, rscale, bscale,
                            *scalars, **consts)
            LAUNCHES["fwd"] += 1
            return out, new_res, rstd, mean
    # The launchers' stride contract: activations may have any strides (rows are passed
    # by stride, columns must be unit-stride or are copied: `rows`); weight and bias are
    # made unit-stride (`vec`). Outputs and statistics are allocated here, contiguous.
    # Rows are passed as a tensor and its row stride, contiguous ones as they are (`row_arg`).
    d, dev = x.shape[-1], x.device
    (x2, s_x), (x12, s_x1) = row_arg(x, d), row_arg(x1, d)
    (r2, s_r), (z2, s_z) = row_arg(residual, d), row_arg(gate, d)
    weight, bias, rscale, bscale = vec(weight), vec(bias), vec(rscale), vec(bscale)
    M, G = x.numel() // d, spec.groups
    # Outputs in x's shape, the kernel writing through them by row (a view of them only
    # where they are not contiguous): a returned view would be one autograd refuses to let
    # users edit in place.
    if out is None:
        # the kernel stores in its dtype (uint8 codes for a quantized output)
        out = torch.empty(x.shape, dtype=spec.out_dtype_for(x.dtype), device=dev) if _codes is None else _codes
        new_res = torch.empty(x.shape, dtype=residual_dtype, device=dev) if residual_dtype is not None else None
    o2, s_o = out_arg(out, M, d)
    ro2, s_ro = (None, 0) if new_res is None else out_arg(new_res, M, d)
    rstd = torch.empty((M, G), dtype=torch.float32, device=dev) if need_stats else None
    mean = torch.empty((M, G), dtype=torch.float32, device=dev) if need_stats and spec.center else None
    if M > 0:
        lay = _fwd_layout(d, spec)
        if not lay.tile and spec.dropout_p > 0:
            # the loop kernel regenerates the masks in both passes: in 256 threads it took 128
            # registers and 24 bytes of stack a thread (fp32, sm_90), in 512 66 to 72 and none
            lay = lay._replace(warps=warps(512), per_sm=fit_per_sm(warps(512)))
        args = (x2, x12, r2, z2, weight, bias, o2, ro2, rstd, mean, seed, rscale, bscale, s_x, s_x1, s_r, s_z, s_o,
                s_ro)
        flags = _fwd_flags(x12, r2, weight, bias, spec, new_res is not None, need_stats, rscale, bscale)
        if lay.tile:
            br = max(lay.br, 32) if spec.mx_columnwise else lay.br
            _fwd_tile_ = launch.traced(_fwd_tile) if launch.TRACING.on else _fwd_tile
            _fwd_tile_[(cdiv(M, br),)](*args, M, G, d // G, spec.eps, spec.scale, spec.weight_offset,
                                      *_branch(spec), BR=br, BG=lay.bg, BD=lay.bd, num_warps=lay.warps,
                                      FLAGS=fold_flags(flags), **(_quant or {}))
        else:
            variant = lay.variant("_fwd_loop", (x2, x12, r2, z2, weight, bias, o2, ro2), flags)
            n_prog = min(M * G, num_sms(dev) * programs_per_sm(dev, variant, lay.per_sm))
            _fwd_loop_ = launch.traced(_fwd_loop) if launch.TRACING.on else _fwd_loop
            compiled = _fwd_loop_[(n_prog,)](*args, M * G, G, d // G, spec.eps, spec.scale, spec.weight_offset,
                                            *_branch(spec), BD=lay.bd, num_warps=lay.warps, **flags)
            learn(dev, variant, compiled, lay.warps)
        LAUNCHES["fwd"] += 1
    return out, new_res, rstd, mean


# Backward launches of contiguous tensors (the tile kernel's), laid out once per static
# signature as _FWD_PLANS, deterministic mode and the occupancy learned so far included:
# (spec, the tile's layout, its programs, whether they leave partial rows to sum, its
# variant, whether that was learned, the row strides and scalars, the constexprs, the
# partial-row sum's columns per program), or (spec, None) for the column kernels.
_BWD_PLANS: dict = {}


def _bwd_plan(p, gate, weight, bias, dout, dres, spec: NormSpec, x_dtype, residual_grad_dtype, has_x1) -> tuple:
    d = p.shape[-1]
    M, G = p.numel() // d, spec.groups
    lay = bwd_layout(d, G)
    if M == 0 or not lay.tile:
        return spec, None
    flags = _bwd_flags(has_x1 and spec.dropout_p > 0, dres is not None, residual_grad_dtype is not None,
                       weight is not None, bias is not None, spec)
    # the compiled variant, as norm_bwd names it: the dtypes of (p, gate, weight, bias, dout, dres, dx,
    # dresidual, dgate), all in the plan's key
    dx, dr, dz = (p.new_empty(0, dtype=t) if t is not None else None
                  for t in (x_dtype, residual_grad_dtype, None if gate is None else gate.dtype))
    variant = lay.variant("_bwd_tile", (p, gate, weight, bias, dout, dres, dx, dr, dz), flags)
    n_blocks = cdiv(M, lay.br)
    limit = min(n_blocks, cdiv(M, MIN_ROWS_PER_PROGRAM))
    strides = (d if gate is not None else 0, d, d if dres is not None else 0, d,
               0 if residual_grad_dtype is None else d, 0 if gate is None else d, 0, 0, 0)  # (no [d] scales here)
    scalars = (d, *strides, M, G, d // G, spec.scale, spec.weight_offset, *_branch(spec))
    consts = dict(BR=lay.br, BG=lay.bg, BD=lay.bd, num_warps=lay.warps, FLAGS=fold_flags(flags))
    # one wave of programs at most, as norm_bwd (deterministic mode and what was learned are in the key)
    n_prog = min(limit, row_programs(p.device, variant, lay.per_sm))
    sum_parts = (weight is not None or bias is not None) and n_blocks > 1 and n_prog != 1
    return (spec, lay, n_prog, sum_parts, variant, occupancy.learned(p.device, variant), scalars, consts,
            launch.sum_cols(d, p.device))


def _bwd_flags(has_dx1: bool, has_dro: bool, store_dr: bool, has_w: bool, has_b: bool, spec: NormSpec, rscale=None,
               bscale=None) -> dict:
    """The backward kernels' constexpr flags."""
    return dict(HAS_X1=has_dx1, DROPOUT=spec.dropout_p > 0, HAS_DRO=has_dro, STORE_DR=store_dr, HAS_W=has_w,
                HAS_B=has_b, CENTER=spec.center, GATE=int(spec.gate), ACT=int(spec.act),
                R_SCALE=scale_mode(spec.residual_scale, rscale), BS_VEC=bscale is not None)


@launch.on_device(2)
def norm_bwd(dout, dres, p, gate, weight, bias, rstd, mean, spec: NormSpec, x_dtype, residual_grad_dtype,
             seed=None, has_x1=False, residual=None, x=None, x1=None, rscale=None, bscale=None):
    """Triton backward. Returns (dx, dresidual or None, dgate, dw, db, dx1 or None,
    drscale or None, dbscale or None).

    dx is in x_dtype; a separate dresidual is written only when residual_grad_dtype is
    given: the residual's dtype differs (an fp32 residual stream under bf16 activations),
    or add_norm's branch (alpha, x1, dropout) makes dx another tensor than dresidual = dp.
    Otherwise dx serves both. dx1 (has_x1, with dropout: else dx1 is dx) is in x_dtype;
    the dropout masks are regenerated from the forward's seed. dw and db come in the
    weight's and the bias's dtype. With the [d] scales rscale (residual given) and bscale
    (x, and x1 when has_x1, given), dresidual = a * dp and dx = b * ... * dp, and their
    gradients, sums over rows of dp * residual and dp * (drop(x) + drop(x1)), come in
    their dtypes, summed beside dw and db.

    At most two launches, torch ops included: `_bwd_tile`, then `_bwd_sum` adding up its
    dw/db partial rows (none when one program ran, or with no weight and no bias); wide
    rows `_bwd_dots` + `_bwd_cols`, which sums its own partial rows.
    """
    if p.is_cuda and p.get_device() != torch._C._cuda_getDevice():  # launch.on_device
        return launch.on_its_device(norm_bwd, p, locals())
    if (spec.serial is not None and not launch.TRACING.on and rscale is None and bscale is None
            and p.is_contiguous() and dout.is_contiguous()
            and (dres is None or dres.is_contiguous())
            and (gate is None or gate.is_contiguous()) and (weight is None or weight.is_contiguous())
            and (bias is None or bias.is_contiguous())):
        key = (spec.serial, p.shape, p.dtype, p.device, dout.dtype, None if dres is None else dres.dtype,
               None if gate is None else gate.dtype, None if weight is None else weight.dtype,
               None if bias is None else bias.dtype, x_dtype, residual_grad_dtype, seed.__class__, has_x1,
               _deterministic(), occupancy.GENERATION, launch.MAX_TILE_BWD, launch.BWD_WIDE_TILE,
               launch.BWD_PER_THREAD, launch.MAX_ROWS, launch.WARP, launch.SM_THREADS, launch.H100_SMS,
               MIN_ROWS_PER_PROGRAM, launch.SUM_TILE, launch.SUM_MIN_COLS, launch.DETERMINISTIC_PROGRAMS,
               launch.DETERMINISTIC_SUM_COLS, launch.BWD_MAX_THREADS)
        try:
            plan = _BWD_PLANS[key]
        except KeyError:
            plan = None
        if plan is None:
            plan = _bwd_plan(p, gate, weight, bias, dout, dres, spec, x_dtype, residual_grad_dtype, has_x1)
            if len(_BWD_PLANS) >= 4096:
                _BWD_PLANS.clear()
            _BWD_PLANS[key] = plan
        if plan[1] is not None:  # the tile kernel (and its partial rows' sum), as laid out
            _, lay, n_prog, sum_parts, variant, learned, scalars, consts, sum_bd = plan
            dev = p.device
            dx = torch.empty(p.shape, dtype=x_dtype, device=dev)
            dr = None if residual_grad_dtype is None else torch.empty(p.shape, dtype=residual_grad_dtype, device=dev)
            dz = torch.empty(p.shape, dtype=gate.dtype, device=dev) if gate is not None else None
            dx1 = torch.empty(p.shape, dtype=x_dtype, device=dev) if consts["FLAGS"] & 1 else None  # HAS_X1
            d = p.shape[-1]
            dw = torch.empty((d,), dtype=weight.dtype, device=dev) if weight is not None else None
            db = torch.empty((d,), dtype=bias.dtype, device=dev) if bias is not None else None
            dw_part = torch.empty((n_prog, d), dtype=torch.float32, device=dev) if sum_parts and dw is not None else dw
            db_part = torch.empty((n_prog, d), dtype=torch.float32, device=dev) if sum_parts and db is not None else db
            compiled = _bwd_tile[(n_prog,)](p, gate, weight, bias, rstd, mean, dout, dres, dx, dr, dz, dw_part, db_part,
                                            dx1, seed, None, None, None, None, None, None, None, *scalars, **consts)
            LAUNCHES["bwd"] += 1
            if sum_parts:
                sum_partial_rows(dw_part, db_part, dw, db, n_prog, d, sum_bd)
                LAUNCHES["bwd"] += 1
            if not learned and compiled is not None:  # a GPU's first launch of the variant (the plan is rebuilt)
                learn(dev, variant, compiled, lay.warps)
            return dx, dr, dz, dw, db, dx1, None, None
    d, dev = p.shape[-1], p.device
    # As in norm_fwd. A dout whose columns are not unit-stride (an expanded gradient) is
    # copied by `rows`, a torch op: the caller's layout, not this op's work.
    (p2, s_p), (do2, s_do) = row_arg(p, d), row_arg(dout, d)
    (dro2, s_dro), (z2, s_z) = row_arg(dres, d), row_arg(gate, d)
    weight, bias, rscale, bscale = vec(weight), vec(bias), vec(rscale), vec(bscale)
    # the scaled inputs, read for the [d] scales' gradients only
    (r2, s_r) = row_arg(residual if rscale is not None else None, d)
    (x2, s_x), (x12, s_x1) = (row_arg(t if bscale is not None else None, d) for t in (x, x1))
    M, G = p.numel() // d, spec.groups
    dg = d // G
    # The gradients in p's shape, as norm_fwd's outputs (contiguous: the kernels write them
    # by rows of d)
    grads = (torch.empty(p.shape, dtype=x_dtype, device=dev),
             torch.empty(p.shape, dtype=residual_grad_dtype, device=dev) if residual_grad_dtype is not None else None,
             torch.empty(p.shape, dtype=gate.dtype, device=dev) if gate is not None else None)
    dx1 = torch.empty(p.shape, dtype=x_dtype, device=dev) if has_x1 and spec.dropout_p > 0 else None
    dx, dr, dz = grads
    need_dw, need_db = weight is not None, bias is not None
    if M == 0:  # no rows, no launch: the sums over none are zero (a fill each, for this edge case)
        zeros = [None if t is None else torch.zeros((d,), dtype=t.dtype, device=dev) for t in (weight, bias, rscale,
                                                                                              bscale)]
        return (*grads, *zeros[:2], dx1, *zeros[2:])
    dw = torch.empty((d,), dtype=weight.dtype, device=dev) if need_dw else None
    db = torch.empty((d,), dtype=bias.dtype, device=dev) if need_db else None
    drs = torch.empty((d,), dtype=rscale.dtype, device=dev) if rscale is not None else None
    dbs = torch.empty((d,), dtype=bscale.dtype, device=dev) if bscale is not None else None
    flags = _bwd_flags(dx1 is not None, dro2 is not None, dr is not None, need_dw, need_db, spec, rscale, bscale)
    lay = bwd_layout(d, G)
    if lay.tile:
        n_cols = 1
    else:  # the column-chunk kernel's layout: [BR, BD] blocks, BD columns of one group
        bd = min(COLS_BLOCK, pow2(dg))
        tile = COLS_TILE_DROPOUT if spec.dropout_p > 0 else COLS_TILE
        lay = Layout(False, 1, bd, max(1, tile // bd), warps(256), COLS_PROGRAMS_PER_SM)
        n_cols = G * cdiv(dg, bd)
    n_blocks = cdiv(M, lay.br)
    n_items = n_cols * n_blocks  # the tile's row blocks; the column kernel's (chunk, row block) pairs
    # The variant's registers are those of its main loop: the partial rows' summing
    # (SUM_PARTS below) comes after it, when those are free (bench.py sm90 shows both).
    variant = lay.variant("_bwd_tile" if lay.tile else "_bwd_cols", (p2, z2, weight, bias, do2, dro2, dx, dr, dz),
                          flags)
    # As many programs as fit at once (one wave), the items split evenly among them, and at
    # least MIN_ROWS_PER_PROGRAM rows' worth each, so the partial buffers stay small next
    # to the activations on small batches.
    slots = row_programs(dev, variant, lay.per_sm)
    n_prog = max(1, min(slots, n_items, n_cols * cdiv(M, MIN_ROWS_PER_PROGRAM)))
    # Partial sums are left to add where a (column) chunk's rows are split among programs:
    # with more than one row block, unless the programs divide the chunks evenly (a
    # program's range of items then ends where a chunk does). With one program, or one
    # per chunk, its sums are dw and db: it writes them, and nothing is left to add.
    sum_parts = (need_dw or need_db or drs is not None or dbs is not None) and n_blocks > 1 and n_cols % n_prog != 0
    # The tile's partial rows are its programs'; the column kernel's are one chunk wide, one
    # for each program and chunk it touches: n_prog + n_cols - 1 pairs at most (_bwd_cols).
    part = (n_prog, d) if lay.tile else (n_prog + n_cols - 1, lay.bd)
    dw_part, db_part, drs_part, dbs_part = (torch.empty(part, dtype=torch.float32, device=dev)
                                            if g is not None and sum_parts else g for g in (dw, db, drs, dbs))
    strides = (s_p, s_z, s_do, s_dro, d, 0 if dr is None else d, 0 if dz is None else d, s_r, s_x, s_x1)
    outs = (do2, dro2, dx, dr, dz, dw_part, db_part, dx1, seed, r2, x2, x12, rscale, bscale, drs_part, dbs_part)
    if lay.tile:
        _bwd_tile_ = launch.traced(_bwd_tile) if launch.TRACING.on else _bwd_tile
        compiled = _bwd_tile_[(n_prog,)](p2, z2, weight, bias, rstd, mean, *outs, *strides, M, G, dg, spec.scale,
                                        spec.weight_offset, *_branch(spec), BR=lay.br, BG=lay.bg, BD=lay.bd,
                                        num_warps=lay.warps, FLAGS=fold_flags(flags))
        LAUNCHES["bwd"] += 1
        if sum_parts:
            sum_partial_rows(dw_part, db_part, dw, db, n_prog, d, scales=(drs_part, dbs_part, drs, dbs))
            LAUNCHES["bwd"] += 1
    else:
        dots = torch.empty((M * G, 2), dtype=torch.float32, device=dev)
        cnt = torch.empty((n_cols,), dtype=torch.int32, device=dev) if sum_parts else None  # zeroed by _bwd_dots
        dots_lay = loop_layout(dg)
        dots_flags = dict(BD=dots_lay.bd, HAS_W=need_dw, CENTER=spec.center, GATE=int(spec.gate),
                          ACT=int(spec.act), ZERO_CNT=sum_parts)
        dots_variant = dots_lay.variant("_bwd_dots", (p2, z2, weight, do2), dots_flags)
        n_dots = min(M * G, num_sms(dev) * programs_per_sm(dev, dots_variant, dots_lay.per_sm))
        _bwd_dots_ = launch.traced(_bwd_dots) if launch.TRACING.on else _bwd_dots
        dots_compiled = _bwd_dots_[(n_dots,)](p2, z2, weight, rstd, mean, do2, dots, cnt, s_p, s_z,
                                             s_do, M * G, G, dg, spec.scale, spec.weight_offset, n_cols,
                                             num_warps=dots_lay.warps, **dots_flags)
        learn(dev, dots_variant, dots_compiled, dots_lay.warps)
        _bwd_cols_ = launch.traced(_bwd_cols) if launch.TRACING.on else _bwd_cols
        compiled = _bwd_cols_[(n_prog,)](p2, z2, weight, bias, rstd, mean, dots, *outs, dw, db, drs, dbs, cnt,
                                        *strides,
                                        M, G, dg, spec.scale, spec.weight_offset, *_branch(spec),
                                        BR=lay.br, BD=lay.bd, SUM_PARTS=sum_parts, num_warps=lay.warps, **flags,
                                        **(launch.NO_SPILL if spec.dropout_p > 0 else {}))
        LAUNCHES["bwd"] += 2
    learn(dev, variant, compiled, lay.warps)
    return (*grads, dw, db, dx1, drs, dbs)
