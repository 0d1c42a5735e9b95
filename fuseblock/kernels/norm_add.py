"""Triton kernels for the post-norm and sandwich residual updates, forward and backward:

    norm_add:       new_residual = residual + alpha * N_b(x)
    norm_add_norm:  new_residual = residual + alpha * N_b(x),  out = N(new_residual)

One kernel each way serves both (SECOND: the second norm N is applied). The tile
kernels hold whole rows in registers, [BR rows, BD columns] per block, up to
MAX_TILE_BWD columns (`fits`); wider rows take the loop kernels, which sweep a row (a
block of rows, backward) in column chunks: `_fwd_loop`, `_bwd_loop`.

Launches: one forward at any width; a backward of one (`_bwd_tile`, `_bwd_loop`) plus,
when a weight or bias needs a gradient and the backward left per-program fp32 partial
rows (several tile programs, or the loop kernel), `_bwd_sum4` adding up those of the
four parameter gradients in one launch.

Traffic: forward reads x and residual once and writes new_residual (and out) once, plus
the row statistics (rstd, and mean for a layer norm) of each norm. Backward reads x, the
saved new_residual (only with the second norm), the gradients arriving at out and at
new_residual, and writes dx and dresidual once. The loop kernels read some of these
twice (or three times), always rows the same program has just read or written:
`_fwd_loop` x and new_residual, `_bwd_loop` p, dout and x, and dresidual back. The
launch's distinct bytes stay the minimum; docs/performance.md counts the re-reads.

Names as in `fuseblock.kernels.norm`: X input, R residual, RO new_residual, O out, BW/BB
the branch norm's weight and bias, W/B the second norm's; RSTDB/MEANB and RSTD/MEAN their
row statistics (fp32); a D prefix is a gradient, a P suffix a partial-row buffer.
"""
# No `from __future__ import annotations`: Triton 3.1's interpreter reads the string
# "tl.constexpr" as no annotation (see fuseblock.kernels.norm).

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ..reference import fp8
from ..spec import NormSpec, Quant
from . import launch
from .fp8 import quant_buffers, quantized, store_quantized
from .launch import (
    LAUNCHES,
    Layout,
    cdiv,
    fwd_layout,
    loop_layout,
    num_sms,
    out_arg,
    pow2,
    row_arg,
    row_programs,
    sum_cols,
    sum_rows,
    vec,
    warps,
)
from .occupancy import learn, programs_per_sm
from .row_math import SCALE_NONE, SCALE_VEC, row_mean, row_rstd, row_weight, scale_by, scale_mode, sq_prod

MIN_ROWS_PER_PROGRAM = 64  # as the norm's backward: keeps the partial rows small next to the activations
LOOP_ROWS = 4  # _bwd_loop's rows per block: a program's partial rows are updated once per block
LOOP_TILE = 2048  # and elements per [LOOP_ROWS, columns] chunk, 8 a thread as in bwd_tile_layout


def fits(d: int, backward: bool) -> bool:
    """Whether rows of d columns take the forward's (the backward's) tile kernel, else the
    loop kernels (MAX_TILE_PAIR_FWD, MAX_TILE_PAIR_BWD, read at call time: tests shrink them)."""
    return pow2(d) <= (launch.MAX_TILE_PAIR_BWD if backward else launch.MAX_TILE_PAIR_FWD)


def bwd_tile_layout(d: int) -> Layout:
    """The backward's block: 2048 elements (or one whole row, when wider), 8 per thread.
    It holds two norms' blocks and four parameter-gradient rows live, where the norm's
    backward holds one norm's and two, so the norm's layout would spill. Compiled for
    sm_90 in bf16 (rms and layer): with the norm's layout this kernel spills 304 to 400
    bytes a thread at d = 4096 and 536 to 1328 at 16384; with this one none up to 4096
    (95 to 127 registers), 104 to 240 bytes at 8192 and 328 to 584 at 16384 (32 warps)."""
    bd = pow2(d)
    br = max(1, 2048 // bd)
    w = warps(min(1024, max(128, br * bd // 8)))  # a program has at most 1024 threads
    return Layout(True, 1, bd, br, w, launch.fit_per_sm(w))



def bwd_loop_layout(d: int) -> Layout:
    """`_bwd_loop`'s chunk: LOOP_ROWS rows by LOOP_TILE // LOOP_ROWS columns, 8 warps.
    Rows per block trade the partial rows' updates (one read and one write of each
    parameter's chunk per block) against the rows a program re-reads within a block
    (more rows, further apart in time, less likely still in L2). Not tuned on a GPU."""
    bd = min(pow2(d), max(1, LOOP_TILE // LOOP_ROWS))
    w = warps(256)
    return Layout(False, 1, bd, LOOP_ROWS, w, launch.fit_per_sm(w))

@triton.jit
def _stats(b_s, mask, D, eps, BR: tl.constexpr, BD: tl.constexpr, CENTER: tl.constexpr, EXACT_SQ: tl.constexpr):
    """(q, rstd, mean) of the [BR, BD] block b_s per row, as the norm's tile kernel: a
    layer norm centres on each row's first element before summing (a constant row is
    then exactly q = 0)."""
    if CENTER:
        o_d = tl.arange(0, BD)
        b_shift = tl.sum(tl.where(o_d[None, :] == 0, b_s, 0.0), 1)
        b_c = tl.where(mask, b_s - b_shift[:, None], 0.0)
        b_dmean = row_mean(tl.sum(b_c, 1), D)
        b_mean = b_shift + b_dmean
        b_q = tl.where(mask, b_c - b_dmean[:, None], 0.0)
    else:
        b_mean = tl.zeros([BR], dtype=tl.float32)  # unused: no mean
        b_q = b_s
    b_rstd = row_rstd(tl.sum(sq_prod(b_q, b_q, EXACT_SQ), 1), D, eps, EXACT_SQ)
    return b_q, b_rstd, b_mean


@triton.jit
def _affine(b_r, W, B, o_d, m_d, scale, woff, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """scale * r * (woff + w) + b on a [BR, BD] block of normalized rows, or on one row's
    [BD] chunk (the loop kernel): the weight and bias broadcast over the leading dim."""
    b_o = b_r * scale
    if HAS_W:
        b_o *= row_weight(W, o_d, m_d, woff)
    if HAS_B:
        b_o += tl.load(B + o_d, mask=m_d, other=0.0).to(tl.float32)
    return b_o


@triton.jit(do_not_specialize=["M", "eps_b", "eps", "scale", "woff_b", "woff", "alpha", "rscale", "q_ub"])
def _fwd_tile(
    X, R, BW, BB, W, B, RO, O, RSTDB, MEANB, RSTD, MEAN, RS, BS,
    s_x, s_r, s_ro, s_o,
    M, D, eps_b, eps, scale, woff_b, woff, alpha, rscale,
    BR: tl.constexpr, BD: tl.constexpr,
    HAS_BW: tl.constexpr, HAS_BB: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    SECOND: tl.constexpr, CENTER: tl.constexpr, STORE_STATS: tl.constexpr,
    EXACT_B: tl.constexpr, EXACT: tl.constexpr, R_SCALE: tl.constexpr, BS_VEC: tl.constexpr,
    # the second norm's scaled fp8 output (`fuseblock.kernels.fp8.store_quantized`): O holds its codes
    QS=None, q_max=0.0, q_ub=0.0, q_tiny=0.0, q_tiny_scale=0.0,
    QUANT: tl.constexpr = 0, Q_MBITS: tl.constexpr = 3, Q_BIAS: tl.constexpr = 7, Q_MAXPOW2: tl.constexpr = 8,
    Q_RCEIL: tl.constexpr = False, Q_ROUND: tl.constexpr = 0,
    INTERP: tl.constexpr = False,  # update="interpolate": r + b * (y - r)
):
    i_m = tl.program_id(0)
    o_m = (i_m * BR + tl.arange(0, BR)).to(tl.int64)  # int64: M * stride may pass 2**31
    o_d = tl.arange(0, BD)
    m_m = o_m < M
    m_d = o_d < D
    mask = m_m[:, None] & m_d[None, :]
    row = o_m[:, None]
    col = o_d[None, :]
    b_x = tl.load(X + row * s_x + col, mask=mask, other=0.0).to(tl.float32)
    b_q, b_rstdb, b_meanb = _stats(b_x, mask, D, eps_b, BR, BD, CENTER, EXACT_B)
    b_y = _affine(b_q * b_rstdb[:, None], BW, BB, o_d, m_d, scale, woff_b, HAS_BW, HAS_BB)
    # new_residual from the fp32 branch, rounded once; the second norm reads the stored value
    b_p = _residual_update(R, RS, BS, row * s_r + col, row * 0 + col, mask, b_y, alpha, rscale, R_SCALE, BS_VEC,
                           INTERP)
    b_pr = b_p.to(RO.dtype.element_ty)
    tl.store(RO + row * s_ro + col, b_pr, mask=mask)
    if SECOND:
        b_q2, b_rstd, b_mean = _stats(tl.where(mask, b_pr.to(tl.float32), 0.0), mask, D, eps, BR, BD, CENTER, EXACT)
        b_o = _affine(b_q2 * b_rstd[:, None], W, B, o_d, m_d, scale, woff, HAS_W, HAS_B)
        if QUANT == 0:
            tl.store(O + row * s_o + col, b_o.to(O.dtype.element_ty), mask=mask)
        else:  # as one group: [BR, 1, BD]
            store_quantized(O, QS, b_o[:, None, :], o_m, m_m, col, row[:, :, None], mask[:, None, :], s_o, 1, D,
                            q_max, q_ub, q_tiny, q_tiny_scale, QUANT, Q_MBITS, Q_BIAS, Q_MAXPOW2, Q_RCEIL, Q_ROUND,
                            BR, 1, BD)
    if STORE_STATS:
        tl.store(RSTDB + o_m, b_rstdb, mask=m_m)
        if CENTER:
            tl.store(MEANB + o_m, b_meanb, mask=m_m)
        if SECOND:
            tl.store(RSTD + o_m, b_rstd, mask=m_m)
            if CENTER:
                tl.store(MEAN + o_m, b_mean, mask=m_m)


@triton.jit
def _branch_scale(BS, o_c, mask, alpha, BS_VEC: tl.constexpr):
    """b: BS[o_c] in fp32 (a [d] branch scale), else alpha. One return: Triton's compiler
    refuses returns of two types (a block and a scalar), even under a constexpr if."""
    if BS_VEC:
        b_b = tl.load(BS + o_c, mask=mask, other=0.0).to(tl.float32)
    else:
        b_b = alpha
    return b_b


@triton.jit
def _residual_update(R, RS, BS, o_r, o_c, mask, b_y, alpha, rscale, R_SCALE: tl.constexpr, BS_VEC: tl.constexpr,
                     INTERP: tl.constexpr):
    """a * r + b * y in fp32: a none, rscale or RS[o_c] (`scale_by`), b alpha or BS[o_c];
    INTERP: r + b * (y - r) (update="interpolate", no a)."""
    b_r = scale_by(tl.load(R + o_r, mask=mask, other=0.0).to(tl.float32), RS, rscale, o_c, mask, R_SCALE)
    b_b = _branch_scale(BS, o_c, mask, alpha, BS_VEC)
    if INTERP:
        return b_r + b_b * (b_y - b_r)
    return b_r + b_b * b_y


@triton.jit
def _row_stats(PTR, base, D, eps, BD: tl.constexpr, CENTER: tl.constexpr, EXACT_SQ: tl.constexpr):
    """(rstd, mean) of the row of D elements at PTR + base, one sweep over BD-column chunks:
    as the norm's fwd_loop, the sum of squares (RMS), or per lane a count, a running mean
    and the squared deviations from it (Welford), merged relative to lane 0's mean."""
    o_d = tl.arange(0, BD)
    b_n = tl.zeros([BD], dtype=tl.float32)
    b_mu = tl.zeros([BD], dtype=tl.float32)
    if EXACT_SQ:
        b_sq = tl.zeros([BD], dtype=tl.float64)
    else:
        b_sq = tl.zeros([BD], dtype=tl.float32)
    for i_d in range(0, D, BD):
        m_d = i_d + o_d < D
        b_s = tl.load(PTR + base + i_d + o_d, mask=m_d, other=0.0).to(tl.float32)
        if CENTER:
            b_n += tl.where(m_d, 1.0, 0.0)
            b_delta = tl.where(m_d, b_s - b_mu, 0.0)
            b_mu += b_delta / tl.maximum(b_n, 1.0)
            b_sq += sq_prod(b_delta, b_s - b_mu, EXACT_SQ)
        else:
            b_sq += sq_prod(b_s, b_s, EXACT_SQ)
    if CENTER:
        b_mu0 = tl.sum(tl.where(o_d == 0, b_mu, 0.0), 0)
        b_mean = b_mu0 + row_mean(tl.sum(b_n * (b_mu - b_mu0), 0), D)
        b_dev = b_mu - b_mean
        b_rstd = row_rstd(tl.sum(b_sq, 0) + tl.sum(sq_prod(b_n * b_dev, b_dev, EXACT_SQ), 0), D, eps, EXACT_SQ)
    else:
        b_mean = 0.0
        b_rstd = row_rstd(tl.sum(b_sq, 0), D, eps, EXACT_SQ)
    return b_rstd, b_mean


@triton.jit(do_not_specialize=["M", "eps_b", "eps", "scale", "woff_b", "woff", "alpha", "rscale"])
def _fwd_loop(
    X, R, BW, BB, W, B, RO, O, RSTDB, MEANB, RSTD, MEAN, RS, BS,
    s_x, s_r, s_ro, s_o,
    M, D, eps_b, eps, scale, woff_b, woff, alpha, rscale,
    BD: tl.constexpr,
    HAS_BW: tl.constexpr, HAS_BB: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    SECOND: tl.constexpr, CENTER: tl.constexpr, STORE_STATS: tl.constexpr,
    EXACT_B: tl.constexpr, EXACT: tl.constexpr, R_SCALE: tl.constexpr, BS_VEC: tl.constexpr,
    INTERP: tl.constexpr = False,
):
    # Rows too wide for registers, persistent over rows: x's statistics (a sweep over x),
    # new_residual written (x and residual read), then N's statistics and out (two sweeps
    # over the stored new_residual). Reads x twice and new_residual twice.
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_d = tl.arange(0, BD)
    for i_it in range(i_p, M, n_p):
        i_m = tl.cast(i_it, tl.int64)
        b_rstdb, b_meanb = _row_stats(X, i_m * s_x, D, eps_b, BD, CENTER, EXACT_B)
        for i_d in range(0, D, BD):
            o_col = i_d + o_d
            m_d = o_col < D
            b_x = tl.load(X + i_m * s_x + o_col, mask=m_d, other=0.0).to(tl.float32)
            b_q = b_x - b_meanb if CENTER else b_x
            b_y = _affine(b_q * b_rstdb, BW, BB, o_col, m_d, scale, woff_b, HAS_BW, HAS_BB)
            b_p = _residual_update(R, RS, BS, i_m * s_r + o_col, o_col, m_d, b_y, alpha, rscale, R_SCALE, BS_VEC,
                                   INTERP)
            tl.store(RO + i_m * s_ro + o_col, b_p.to(RO.dtype.element_ty), mask=m_d)
        if SECOND:
            b_rstd, b_mean = _row_stats(RO, i_m * s_ro, D, eps, BD, CENTER, EXACT)
            for i_d in range(0, D, BD):
                o_col = i_d + o_d
                m_d = o_col < D
                b_p = tl.load(RO + i_m * s_ro + o_col, mask=m_d, other=0.0).to(tl.float32)
                b_q = b_p - b_mean if CENTER else b_p
                b_o = _affine(b_q * b_rstd, W, B, o_col, m_d, scale, woff, HAS_W, HAS_B)
                tl.store(O + i_m * s_o + o_col, b_o.to(O.dtype.element_ty), mask=m_d)
        if STORE_STATS:
            tl.store(RSTDB + i_m, b_rstdb)
            if CENTER:
                tl.store(MEANB + i_m, b_meanb)
            if SECOND:
                tl.store(RSTD + i_m, b_rstd)
                if CENTER:
                    tl.store(MEAN + i_m, b_mean)


@triton.jit
def _norm_bwd(b_s, b_do, RSTD, MEAN, W, o_m, m_m, o_d, m_d, mask, D, scale, woff,
              HAS_W: tl.constexpr, CENTER: tl.constexpr):
    """The norm's backward on a [BR, BD] block (docs/math.md): (ds, the block's column sums
    of dw's terms). r = q * rstd, dr = do * scale * (woff + w),
    dq = (dr - mean(r * dr) r) * rstd, less its mean for a layer norm."""
    b_rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)[:, None]
    if CENTER:
        b_r = tl.where(mask, b_s - tl.load(MEAN + o_m, mask=m_m, other=0.0)[:, None], 0.0) * b_rstd
    else:
        b_r = b_s * b_rstd
    b_dr = b_do * scale
    if HAS_W:
        b_dr *= row_weight(W, o_d, m_d, woff)[None, :]
    b_ds = (b_dr - b_r * row_mean(tl.sum(b_r * b_dr, 1), D)[:, None]) * b_rstd
    if CENTER:
        b_ds = tl.where(mask, b_ds - row_mean(tl.sum(b_ds, 1), D)[:, None], 0.0)
    return b_ds, tl.sum(b_do * b_r, 0) * scale


@triton.jit(do_not_specialize=["M", "scale", "woff_b", "woff", "alpha", "rscale"])
def _bwd_tile(
    X, P, BW, W, RSTDB, MEANB, RSTD, MEAN, DO, DRO, DX, DR, DBWP, DBBP, DWP, DBP, R, BB, RS, BS, DRSP, DBSP,
    s_x, s_p, s_do, s_dro, s_dx, s_dr, s_r,
    M, D, scale, woff_b, woff, alpha, rscale,
    BR: tl.constexpr, BD: tl.constexpr,
    HAS_DO: tl.constexpr, HAS_DRO: tl.constexpr, HAS_BW: tl.constexpr, HAS_BB: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, SECOND: tl.constexpr, CENTER: tl.constexpr,
    STORE_DR: tl.constexpr, R_SCALE: tl.constexpr, BS_VEC: tl.constexpr,
    INTERP: tl.constexpr = False,  # r' = r + b * (y - r): dresidual = (1 - b) dp, d b from dp * (y - r)
):
    # A persistent grid, as the norm's _bwd_tile: program i_p handles row blocks i_p,
    # i_p + n_p, ... and writes its four parameter-gradient sums once, as row i_p of the
    # partial buffers (the gradients themselves when it is the only program).
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_dbw = tl.zeros([BD], dtype=tl.float32)
    b_dbb = tl.zeros([BD], dtype=tl.float32)
    b_dw = tl.zeros([BD], dtype=tl.float32)
    b_db = tl.zeros([BD], dtype=tl.float32)
    b_drs = tl.zeros([BD], dtype=tl.float32)  # the [d] scales': sums of dp * r and dp * N_b(x)
    b_dbs = tl.zeros([BD], dtype=tl.float32)
    for i_m in range(i_p, tl.cdiv(M, BR), n_p):
        o_m = (i_m * BR + tl.arange(0, BR)).to(tl.int64)
        m_m = o_m < M
        mask = m_m[:, None] & m_d[None, :]
        row = o_m[:, None]
        col = o_d[None, :]
        o_c = row * 0 + col
        # dp: the gradient at new_residual, through the second norm and directly
        b_dp = tl.zeros([BR, BD], dtype=tl.float32)
        if SECOND and HAS_DO:
            b_p = tl.load(P + row * s_p + col, mask=mask, other=0.0).to(tl.float32)
            b_do = tl.load(DO + row * s_do + col, mask=mask, other=0.0).to(tl.float32)
            b_dp, b_sw = _norm_bwd(b_p, b_do, RSTD, MEAN, W, o_m, m_m, o_d, m_d, mask, D, scale, woff,
                                   HAS_W, CENTER)
            b_dw += b_sw
            b_db += tl.sum(b_do, 0)
        if HAS_DRO:
            b_dp += tl.load(DRO + row * s_dro + col, mask=mask, other=0.0).to(tl.float32)
        b_b = _branch_scale(BS, o_c, mask, alpha, BS_VEC)
        if STORE_DR:  # dresidual = a * dp, or (1 - b) * dp
            if INTERP:
                b_dres = b_dp - b_b * b_dp
            else:
                b_dres = scale_by(b_dp, RS, rscale, o_c, mask, R_SCALE)
            tl.store(DR + row * s_dr + col, b_dres.to(DR.dtype.element_ty), mask=mask)
        b_x = tl.load(X + row * s_x + col, mask=mask, other=0.0).to(tl.float32)
        if R_SCALE == SCALE_VEC:
            b_drs += tl.sum(b_dp * tl.load(R + row * s_r + col, mask=mask, other=0.0).to(tl.float32), 0)
        if BS_VEC:  # N_b(x) rebuilt from x and its statistics, for d b
            b_rstdb = tl.load(RSTDB + o_m, mask=m_m, other=0.0)[:, None]
            b_rb = tl.where(mask, b_x - tl.load(MEANB + o_m, mask=m_m, other=0.0)[:, None], 0.0) if CENTER else b_x
            b_y = _affine(b_rb * b_rstdb, BW, BB, o_d, m_d, scale, woff_b, HAS_BW, HAS_BB)
            if INTERP:  # d b = sum of dp * (y - r)
                b_y -= tl.load(R + row * s_r + col, mask=mask, other=0.0).to(tl.float32)
            b_dbs += tl.sum(b_dp * b_y, 0)
        # the branch: dy = b * dp, then the branch norm's backward to x
        b_dy = b_dp * b_b
        b_dx, b_sbw = _norm_bwd(b_x, b_dy, RSTDB, MEANB, BW, o_m, m_m, o_d, m_d, mask, D, scale, woff_b,
                                HAS_BW, CENTER)
        tl.store(DX + row * s_dx + col, b_dx.to(DX.dtype.element_ty), mask=mask)
        b_dbw += b_sbw
        b_dbb += tl.sum(b_dy, 0)
    o_part = i_p.to(tl.int64) * D + o_d
    if HAS_BW:
        tl.store(DBWP + o_part, b_dbw.to(DBWP.dtype.element_ty), mask=m_d)
    if HAS_BB:
        tl.store(DBBP + o_part, b_dbb.to(DBBP.dtype.element_ty), mask=m_d)
    if HAS_W:
        tl.store(DWP + o_part, b_dw.to(DWP.dtype.element_ty), mask=m_d)
    if HAS_B:
        tl.store(DBP + o_part, b_db.to(DBP.dtype.element_ty), mask=m_d)
    if R_SCALE == SCALE_VEC:
        tl.store(DRSP + o_part, b_drs.to(DRSP.dtype.element_ty), mask=m_d)
    if BS_VEC:
        tl.store(DBSP + o_part, b_dbs.to(DBSP.dtype.element_ty), mask=m_d)


@triton.jit
def _normalized(S, o_s, mask, b_rstd, b_mean, CENTER: tl.constexpr):
    """r = (s - mean) * rstd on a [BR, BD] chunk of rows, from their (BR,) statistics."""
    b_s = tl.load(S + o_s, mask=mask, other=0.0).to(tl.float32)
    if CENTER:
        b_s = tl.where(mask, b_s - b_mean[:, None], 0.0)
    return b_s * b_rstd[:, None]


@triton.jit
def _add_part(PART, o_part, m_d, m_old, b_add):
    """PART[o_part] += b_add on one chunk of a program's fp32 partial row. m_old is False
    on the program's first row block, whose sums are stored over whatever the new buffer
    held: no zero-filling launch, and no read."""
    tl.store(PART + o_part, tl.load(PART + o_part, mask=m_d & m_old, other=0.0) + b_add, mask=m_d)


@triton.jit
def _dp_again(P, DO, DRO, W, o_p, o_do, o_dro, o_col, m_d, mask, b_rstd, b_mean, b_c1, b_c2, scale, woff,
              HAS_W: tl.constexpr, HAS_DRO: tl.constexpr, CENTER: tl.constexpr):
    """_bwd_loop's dp on one chunk as its sweep 2 forms it (N's backward from the row
    constants, plus dresidual), for sweep 3 where DR holds a * dp (a residual scale)."""
    b_r = _normalized(P, o_p, mask, b_rstd, b_mean, CENTER)
    b_dr = tl.load(DO + o_do, mask=mask, other=0.0).to(tl.float32) * scale
    if HAS_W:
        b_dr *= row_weight(W, o_col, m_d, woff)[None, :]
    b_dp = (b_dr - b_r * b_c1[:, None]) * b_rstd[:, None]
    if CENTER:
        b_dp = tl.where(mask, b_dp - b_c2[:, None], 0.0)
    if HAS_DRO:
        b_dp += tl.load(DRO + o_dro, mask=mask, other=0.0).to(tl.float32)
    return b_dp


@triton.jit(do_not_specialize=["M", "scale", "woff_b", "woff", "alpha", "rscale"])
def _bwd_loop(
    X, P, BW, W, RSTDB, MEANB, RSTD, MEAN, DO, DRO, DX, DR, DBWP, DBBP, DWP, DBP, R, BB, RS, BS, DRSP, DBSP,
    s_x, s_p, s_do, s_dro, s_dx, s_dr, s_r,
    M, D, scale, woff_b, woff, alpha, rscale,
    BR: tl.constexpr, BD: tl.constexpr,
    HAS_DO: tl.constexpr, HAS_DRO: tl.constexpr, HAS_BW: tl.constexpr, HAS_BB: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, SECOND: tl.constexpr, CENTER: tl.constexpr,
    STORE_DR: tl.constexpr, R_SCALE: tl.constexpr, BS_VEC: tl.constexpr,
    INTERP: tl.constexpr = False,
):
    # Rows too wide for registers, in one launch: program i_p handles blocks of BR rows
    # i_p, i_p + n_p, ..., three sweeps over each block's column chunks, since each norm's
    # backward needs a whole-row sum before any of its dx (docs/math.md):
    #   1. N's row constants mean(r * dr) and mean(dq), from p and dout (SECOND);
    #   2. dp = N's backward + dresidual, stored as dresidual; from it and x the branch
    #      norm's row constants; every parameter's gradient terms;
    #   3. dx, from x and dp read back.
    # Each sweep re-reads rows this program has just touched (a cache hit where they are
    # still in L2), where two launches (the norm's bwd_dots + bwd_cols) re-read them
    # from memory. The parameters' column sums go to this program's fp32 partial rows,
    # updated once per block, and _bwd_sum4 adds those up.
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_d = tl.arange(0, BD)
    N_BWD: tl.constexpr = SECOND and HAS_DO  # dp has N's backward in it
    for i_b in range(i_p, tl.cdiv(M, BR), n_p):
        o_m = (i_b * BR + tl.arange(0, BR)).to(tl.int64)
        m_m = o_m < M
        row = o_m[:, None]
        # the partial rows hold an earlier block's sums (a [BD] block: Triton's
        # interpreter refuses a mask made with a scalar)
        m_old = tl.full([BD], i_b, tl.int32) > i_p
        if N_BWD:
            b_rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)
            b_mean = tl.load(MEAN + o_m, mask=m_m, other=0.0) if CENTER else None
            b_c1 = tl.zeros([BR], dtype=tl.float32)  # sum r * dr
            b_c2 = tl.zeros([BR], dtype=tl.float32)  # sum dr
            b_c3 = tl.zeros([BR], dtype=tl.float32)  # sum r
            for i_d in range(0, D, BD):
                o_col = i_d + o_d
                m_d = o_col < D
                mask = m_m[:, None] & m_d[None, :]
                col = o_col[None, :]
                b_r = _normalized(P, row * s_p + col, mask, b_rstd, b_mean, CENTER)
                b_dr = tl.load(DO + row * s_do + col, mask=mask, other=0.0).to(tl.float32) * scale
                if HAS_W:
                    b_dr *= row_weight(W, o_col, m_d, woff)[None, :]
                b_c1 += tl.sum(b_r * b_dr, 1)
                if CENTER:
                    b_c2 += tl.sum(b_dr, 1)
                    b_c3 += tl.sum(b_r, 1)
            b_c1 = row_mean(b_c1, D)
            if CENTER:  # mean(dq) = rstd * (mean(dr) - c1 * mean(r)), as the norm's bwd_dots
                b_c2 = (row_mean(b_c2, D) - b_c1 * row_mean(b_c3, D)) * b_rstd
        b_rstdb = tl.load(RSTDB + o_m, mask=m_m, other=0.0)
        b_meanb = tl.load(MEANB + o_m, mask=m_m, other=0.0) if CENTER else None
        b_e1 = tl.zeros([BR], dtype=tl.float32)  # the branch's sums, as b_c1 .. b_c3
        b_e2 = tl.zeros([BR], dtype=tl.float32)
        b_e3 = tl.zeros([BR], dtype=tl.float32)
        for i_d in range(0, D, BD):
            o_col = i_d + o_d
            m_d = o_col < D
            mask = m_m[:, None] & m_d[None, :]
            col = o_col[None, :]
            o_part = i_p.to(tl.int64) * D + o_col
            b_dp = tl.zeros([BR, BD], dtype=tl.float32)
            if N_BWD:
                b_r = _normalized(P, row * s_p + col, mask, b_rstd, b_mean, CENTER)
                b_do = tl.load(DO + row * s_do + col, mask=mask, other=0.0).to(tl.float32)
                b_dr = b_do * scale
                if HAS_W:
                    b_dr *= row_weight(W, o_col, m_d, woff)[None, :]
                    _add_part(DWP, o_part, m_d, m_old, tl.sum(b_do * b_r, 0) * scale)
                if HAS_B:
                    _add_part(DBP, o_part, m_d, m_old, tl.sum(b_do, 0))
                b_dp = (b_dr - b_r * b_c1[:, None]) * b_rstd[:, None]
                if CENTER:
                    b_dp = tl.where(mask, b_dp - b_c2[:, None], 0.0)
            else:  # no gradient reaches out: N's parameters get zeros, as from the tile kernel
                if HAS_W:
                    _add_part(DWP, o_part, m_d, m_old, tl.zeros([BD], dtype=tl.float32))
                if HAS_B:
                    _add_part(DBP, o_part, m_d, m_old, tl.zeros([BD], dtype=tl.float32))
            if HAS_DRO:
                b_dp += tl.load(DRO + row * s_dro + col, mask=mask, other=0.0).to(tl.float32)
            # dresidual rounded once; the branch takes that stored value (as the unfused
            # form, and as sweep 3, which reads it back)
            o_c = row * 0 + col
            b_b = _branch_scale(BS, o_c, mask, alpha, BS_VEC)
            if STORE_DR:
                b_dpr = b_dp.to(DR.dtype.element_ty)
                if INTERP:  # dresidual = (1 - b) * dp
                    b_dra = b_dpr.to(tl.float32) - b_b * b_dpr.to(tl.float32)
                    tl.store(DR + row * s_dr + col, b_dra.to(DR.dtype.element_ty), mask=mask)
                elif R_SCALE == SCALE_NONE:
                    tl.store(DR + row * s_dr + col, b_dpr, mask=mask)
                else:  # dresidual = a * dp
                    b_dra = scale_by(b_dpr.to(tl.float32), RS, rscale, o_c, mask, R_SCALE)
                    tl.store(DR + row * s_dr + col, b_dra.to(DR.dtype.element_ty), mask=mask)
            else:  # dp is dres as it came (norm_add_bwd's store_dr), already in its dtype
                b_dpr = b_dp
            b_dpf = b_dpr.to(tl.float32)
            b_rb = _normalized(X, row * s_x + col, mask, b_rstdb, b_meanb, CENTER)
            if R_SCALE == SCALE_VEC:  # the [d] scales' terms: dp * r and dp * N_b(x)
                _add_part(DRSP, o_part, m_d, m_old, tl.sum(b_dpf * tl.load(R + row * s_r + col, mask=mask,
                                                                           other=0.0).to(tl.float32), 0))
            if BS_VEC:
                b_y = _affine(b_rb, BW, BB, o_col, m_d, scale, woff_b, HAS_BW, HAS_BB)
                if INTERP:  # d b = sum of dp * (y - r)
                    b_y -= tl.load(R + row * s_r + col, mask=mask, other=0.0).to(tl.float32)
                _add_part(DBSP, o_part, m_d, m_old, tl.sum(tl.where(mask, b_dpf * b_y, 0.0), 0))
            b_dy = b_dpf * b_b
            b_dyw = b_dy * scale
            if HAS_BW:
                b_dyw *= row_weight(BW, o_col, m_d, woff_b)[None, :]
                _add_part(DBWP, o_part, m_d, m_old, tl.sum(b_dy * b_rb, 0) * scale)
            if HAS_BB:
                _add_part(DBBP, o_part, m_d, m_old, tl.sum(b_dy, 0))
            b_e1 += tl.sum(b_rb * b_dyw, 1)
            if CENTER:
                b_e2 += tl.sum(b_dyw, 1)
                b_e3 += tl.sum(b_rb, 1)
        b_e1 = row_mean(b_e1, D)
        if CENTER:
            b_e2 = (row_mean(b_e2, D) - b_e1 * row_mean(b_e3, D)) * b_rstdb
        # sweep 3 reads dp back, and the next block's updates the partial rows, which
        # other threads of this program may have stored: a barrier orders them
        tl.debug_barrier()
        for i_d in range(0, D, BD):
            o_col = i_d + o_d
            m_d = o_col < D
            mask = m_m[:, None] & m_d[None, :]
            col = o_col[None, :]
            if R_SCALE != SCALE_NONE or INTERP:  # DR holds a * dp or (1 - b) dp: dp formed again, as sweep 2 rounded it
                if N_BWD:
                    b_dp = _dp_again(P, DO, DRO, W, row * s_p + col, row * s_do + col, row * s_dro + col, o_col,
                                     m_d, mask, b_rstd, b_mean, b_c1, b_c2, scale, woff, HAS_W, HAS_DRO, CENTER)
                else:
                    b_dp = tl.zeros([BR, BD], dtype=tl.float32)
                    if HAS_DRO:
                        b_dp += tl.load(DRO + row * s_dro + col, mask=mask, other=0.0).to(tl.float32)
                b_dp = b_dp.to(DR.dtype.element_ty).to(tl.float32)
            elif STORE_DR:
                b_dp = tl.load(DR + row * s_dr + col, mask=mask, other=0.0).to(tl.float32)
            else:
                b_dp = tl.load(DRO + row * s_dro + col, mask=mask, other=0.0).to(tl.float32)
            if BS_VEC:
                b_dyw = scale * b_dp * tl.load(BS + row * 0 + col, mask=mask, other=0.0).to(tl.float32)
            else:
                b_dyw = alpha * scale * b_dp
            if HAS_BW:
                b_dyw *= row_weight(BW, o_col, m_d, woff_b)[None, :]
            b_rb = _normalized(X, row * s_x + col, mask, b_rstdb, b_meanb, CENTER)
            b_dx = (b_dyw - b_rb * b_e1[:, None]) * b_rstdb[:, None]
            if CENTER:
                b_dx = tl.where(mask, b_dx - b_e2[:, None], 0.0)
            tl.store(DX + row * s_dx + col, b_dx.to(DX.dtype.element_ty), mask=mask)
        tl.debug_barrier()


@triton.jit(do_not_specialize=["n_rows"])
def _bwd_sum4(DBWP, DBBP, DWP, DBP, DBW, DBB, DW, DB, n_rows, D, BR: tl.constexpr, BD: tl.constexpr,
              HAS_BW: tl.constexpr, HAS_BB: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
              DRSP=None, DBSP=None, DRS=None, DBS=None):
    # The backward's second launch: the four parameters' gradients, each in its own dtype,
    # from the (n_rows, D) fp32 partial rows of _bwd_tile (launch._bwd_sum, for four), and
    # the [d] scales' where given.
    o_col = tl.program_id(0) * BD + tl.arange(0, BD)
    m_col = o_col < D
    if HAS_BW:
        sum_rows(DBWP, DBW, n_rows, D, o_col, m_col, BR, BD)
    if HAS_BB:
        sum_rows(DBBP, DBB, n_rows, D, o_col, m_col, BR, BD)
    if HAS_W:
        sum_rows(DWP, DW, n_rows, D, o_col, m_col, BR, BD)
    if HAS_B:
        sum_rows(DBP, DB, n_rows, D, o_col, m_col, BR, BD)
    if DRS is not None:
        sum_rows(DRSP, DRS, n_rows, D, o_col, m_col, BR, BD)
    if DBS is not None:
        sum_rows(DBSP, DBS, n_rows, D, o_col, m_col, BR, BD)


# --------------------------------------------------------------------------- launchers
def _flag_eps(spec: NormSpec) -> bool:
    return spec.eps == 0  # EXACT_SQ: see fuseblock.kernels.norm._rstd


@launch.on_device(0)
def norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias, branch_spec: NormSpec, spec: NormSpec,
                 alpha: float, residual_dtype, second: bool, need_stats: bool, qscale=None, rscale=None, bscale=None):
    """(new_residual, out or None, rstd_b, mean_b, rstd, mean), the statistics (M,) fp32 or
    None; same contract as `fuseblock.reference.norm.norm_add_fwd`. With spec.quant, out is
    `fuseblock.reference.fp8.Quantized` (qscale: fp8_tensor's static scale), written by the tile
    kernel; rows too wide for it are normed into fp32 and cast by `fuseblock.reference.fp8.quantize`.
    new_residual = a * residual + b * N_b(x): a branch_spec.residual_scale or the [d] tensor
    rscale, b alpha or the [d] tensor bscale."""
    if x.is_cuda and x.get_device() != torch._C._cuda_getDevice():  # launch.on_device
        return launch.on_its_device(norm_add_fwd, x, locals())
    d = x.shape[-1]
    quant, codes = {}, None
    if spec.quant != Quant.NONE:
        if not fits(d, False):
            plain = replace(spec, quant=Quant.NONE, out_dtype=spec.quant_from or torch.float32)
            new_res, out, *stats = norm_add_fwd(x, residual, branch_weight, branch_bias, weight, bias, branch_spec,
                                                plain, alpha, residual_dtype, second, need_stats)
            return (new_res, fp8.quantize(out, spec, qscale), *stats)
        codes, qs, quant = quant_buffers(x, spec, qscale)
    (x2, s_x), (r2, s_r) = row_arg(x, d), row_arg(residual, d)  # contiguous ones as they are
    branch_weight, branch_bias, weight, bias, rscale, bscale = map(vec, (branch_weight, branch_bias, weight, bias,
                                                                         rscale, bscale))
    M = x.numel() // d
    dev = x.device
    new_res = torch.empty(x.shape, dtype=residual_dtype, device=dev)
    out = torch.empty(x.shape, dtype=spec.out_dtype_for(x.dtype), device=dev) if second and codes is None else codes
    ro2 = new_res  # contiguous: written by rows of d
    o2, s_o = out_arg(out, M, d) if second else (None, 0)

    def stat(on):
        return torch.empty((M,), dtype=torch.float32, device=dev) if need_stats and on else None

    rstd_b, mean_b = stat(True), stat(spec.center)
    rstd, mean = stat(second), stat(second and spec.center)
    if M > 0:
        # the tile up to MAX_TILE_BWD only: compiled for sm_90 at d = 32768 it spills (16 to
        # 240 bytes a thread, bf16 rms/layer), where 16384 keeps all in 76 to 116 registers
        lay = fwd_layout(d) if fits(d, False) else loop_layout(d)
        args = (x2, r2, branch_weight, branch_bias, weight, bias, ro2, o2, rstd_b, mean_b, rstd, mean, rscale, bscale,
                s_x, s_r, d, s_o,
                # the eps added to the mean of squares: eps / d where the spec adds it to their sum
                # (eps_on_sum, nGPT's unit sphere: q / sqrt(q.q + eps) is (1/sqrt(d)) q / sqrt(q.q/d + eps/d));
                # written out, not a helper: this runs on every kernel-path call
                M, d, branch_spec.eps / d if branch_spec.eps_on_sum else branch_spec.eps,
                spec.eps / d if spec.eps_on_sum else spec.eps, spec.scale, branch_spec.weight_offset,
                spec.weight_offset, alpha, branch_spec.residual_scale)
        flags = dict(HAS_BW=branch_weight is not None, HAS_BB=branch_bias is not None, HAS_W=weight is not None,
                     HAS_B=bias is not None, SECOND=second, CENTER=spec.center, STORE_STATS=need_stats,
                     EXACT_B=_flag_eps(branch_spec), EXACT=_flag_eps(spec), num_warps=lay.warps,
                     R_SCALE=scale_mode(branch_spec.residual_scale, rscale), BS_VEC=bscale is not None,
                     INTERP=branch_spec.interpolate)
        if lay.tile:
            _fwd_tile_ = launch.traced(_fwd_tile) if launch.TRACING.on else _fwd_tile
            _fwd_tile_[(cdiv(M, lay.br),)](*args, BR=lay.br, BD=lay.bd, **flags, **quant)
        else:
            variant = lay.variant("norm_add._fwd_loop", (x2, r2, branch_weight, weight, ro2, o2), flags)
            n_prog = min(M, num_sms(dev) * programs_per_sm(dev, variant, lay.per_sm))
            _fwd_loop_ = launch.traced(_fwd_loop) if launch.TRACING.on else _fwd_loop
            compiled = _fwd_loop_[(n_prog,)](*args, BD=lay.bd, **flags)
            learn(dev, variant, compiled, lay.warps)
        LAUNCHES["fwd"] += 1
    return new_res, (out if codes is None else quantized(codes, qs, spec)), rstd_b, mean_b, rstd, mean


@launch.on_device(2)
def norm_add_bwd(dout, dres, x, p, branch_weight, branch_bias, weight, bias, rstd_b, mean_b, rstd, mean,
                 branch_spec: NormSpec, spec: NormSpec, alpha: float, residual_grad_dtype, second: bool,
                 store_dr: bool = True, residual=None, rscale=None, bscale=None):
    """(dx, dresidual, dbranch_weight, dbranch_bias, dweight, dbias, drscale, dbscale), the
    absent ones None. rscale and bscale: the forward's [d] scales (residual given with rscale):
    dresidual = a * dp, dy = b * dp, and their gradients, sums over rows of dp * residual and
    dp * N_b(x), summed beside the parameters' in the same launches.
    dout (the gradient at out) and dres (at new_residual) may each be None. At most two
    launches: `_bwd_tile` (or `_bwd_loop` for rows wider than the tile), then `_bwd_sum4`
    when programs left partial rows: several tile programs, or any loop kernel.
    store_dr=False (norm_add, dres given in residual_grad_dtype): dresidual is dres itself,
    which r' = r + alpha * N(x) passes through, so nothing is written for it and dresidual
    comes back None; the loop kernel reads dres back where it would read its stored copy."""
    if x.is_cuda and x.get_device() != torch._C._cuda_getDevice():  # launch.on_device
        return launch.on_its_device(norm_add_bwd, x, locals())
    d = x.shape[-1]
    (x2, s_x), (p2, s_p) = row_arg(x, d), row_arg(p, d)  # contiguous ones as they are
    (do2, s_do), (dro2, s_dro) = row_arg(dout, d), row_arg(dres, d)
    # the residual: for a [d] residual scale's gradient, and an interpolation's d b (dp * (y - r))
    r2, s_r = row_arg(residual if rscale is not None or (branch_spec.interpolate and bscale is not None) else None, d)
    branch_weight, weight, rscale, bscale = vec(branch_weight), vec(weight), vec(rscale), vec(bscale)
    bb = vec(branch_bias) if bscale is not None else None  # N_b(x) rebuilt for bscale's gradient
    M = x.numel() // d
    dev = x.device
    dx = torch.empty(x.shape, dtype=x.dtype, device=dev)
    store_dr = (store_dr or second or dro2 is None or dres.dtype != residual_grad_dtype
                or branch_spec.residual_scale != 1.0 or rscale is not None  # dresidual = a * dp: another tensor
                or branch_spec.interpolate)  # (1 - b) * dp
    dr = torch.empty(x.shape, dtype=residual_grad_dtype, device=dev) if store_dr else None
    params = (branch_weight, branch_bias, weight if second else None, bias if second else None, rscale, bscale)
    if M == 0:
        return (dx, dr, *(None if t is None else torch.zeros((d,), dtype=t.dtype, device=dev) for t in params))
    grads = [None if t is None else torch.empty((d,), dtype=t.dtype, device=dev) for t in params]
    lay = bwd_tile_layout(d) if fits(d, True) else bwd_loop_layout(d)
    kernel = _bwd_tile if lay.tile else _bwd_loop
    n_items = cdiv(M, lay.br)
    flags = dict(HAS_DO=do2 is not None, HAS_DRO=dro2 is not None, HAS_BW=params[0] is not None,
                 HAS_BB=params[1] is not None, HAS_W=params[2] is not None, HAS_B=params[3] is not None,
                 SECOND=second, CENTER=spec.center, STORE_DR=store_dr,
                 R_SCALE=scale_mode(branch_spec.residual_scale, rscale), BS_VEC=bscale is not None,
                 INTERP=branch_spec.interpolate)
    variant = lay.variant(f"norm_add.{kernel.fn.__name__}", (x2, p2, branch_weight, weight, do2, dro2), flags)
    slots = row_programs(dev, variant, lay.per_sm)
    n_prog = max(1, min(slots, n_items, cdiv(M, MIN_ROWS_PER_PROGRAM)))
    # a lone tile program writes the gradients themselves; the loop kernel adds a
    # program's blocks up in fp32 partial rows, always summed (and cast) by _bwd_sum4
    sum_parts = (n_prog > 1 or not lay.tile) and any(g is not None for g in grads)
    parts = [None if g is None else (torch.empty((n_prog, d), dtype=torch.float32, device=dev) if sum_parts else g)
             for g in grads]
    p_arg = p2 if second else None  # the second norm's input
    kernel_ = launch.traced(kernel) if launch.TRACING.on else kernel
    compiled = kernel_[(n_prog,)](
        x2, p_arg, branch_weight, weight, rstd_b, mean_b, rstd, mean, do2, dro2, dx, dr, *parts[:4], r2, bb, rscale,
        bscale, *parts[4:],
        s_x, s_p if second else 0, s_do, s_dro,
        d, d if store_dr else 0,  # dx and dr: contiguous, written by rows of d
        s_r, M, d, spec.scale, branch_spec.weight_offset, spec.weight_offset, alpha, branch_spec.residual_scale,
        BR=lay.br, BD=lay.bd, num_warps=lay.warps, **flags,
    )
    learn(dev, variant, compiled, lay.warps)
    LAUNCHES["bwd"] += 1
    if sum_parts:
        bd = sum_cols(d, dev)
        _bwd_sum4_ = launch.traced(_bwd_sum4) if launch.TRACING.on else _bwd_sum4
        scales = {} if rscale is None and bscale is None else dict(DRSP=parts[4], DBSP=parts[5], DRS=grads[4],
                                                                   DBS=grads[5])
        _bwd_sum4_[(cdiv(d, bd),)](*parts[:4], *grads[:4], n_prog, d, BR=max(1, launch.SUM_TILE // bd), BD=bd,
                                  HAS_BW=grads[0] is not None, HAS_BB=grads[1] is not None,
                                  HAS_W=grads[2] is not None, HAS_B=grads[3] is not None, num_warps=4, **scales)
        LAUNCHES["bwd"] += 1
    return (dx, dr, *grads)
