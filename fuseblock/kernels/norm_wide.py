"""The norm kernels for rows too wide for one tile (`fuseblock.kernels.norm` launches them):
the forward `fwd_loop`, which loops over column chunks of one (row, group) at a time, and the
backward's two launches, the per-row constants (`bwd_dots`) then a column-chunk pass
(`bwd_cols`) that sums its own partial rows. The row math is `fuseblock.kernels.row_math`'s,
shared with the tile kernels; names and tensors as in `fuseblock.kernels.norm`.
"""
# No `from __future__ import annotations`: Triton 3.1's interpreter reads the string
# "tl.constexpr" as no annotation and passes BR, BD, ... as arrays (tests/tools/test_floor.py).

import triton
import triton.language as tl

from .launch import sum_rows
from .row_math import (
    GATE_NONE,
    GATE_POST,
    GATE_PRE,
    SCALE_VEC,
    bwd_block,
    check_modes,
    gate_act,
    load_p,
    normalized,
    row_mean,
    row_rstd,
    row_weight,
    sq_prod,
)


@triton.jit(do_not_specialize=["MG", "eps", "scale", "woff", "alpha", "rscale", "drop_p", "drop_scale", "SEED"])
def fwd_loop(
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
            b_s = load_p(X, X1, R, RO, SEED, RS, BS, i_m * s_x + o_col, i_m * s_x1 + o_col, i_m * s_r + o_col,
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
                b_s = load_p(X, X1, R, RO, SEED, RS, BS, i_m * s_x + o_col, i_m * s_x1 + o_col, i_m * s_r + o_col,
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


@triton.jit(do_not_specialize=["MG", "scale", "woff"])
def bwd_dots(
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
    if ZERO_CNT:  # and the n_cnt arrival counters of bwd_cols, which runs next: no launch of their own
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
            b_r = normalized(b_p, b_g, b_rstd, b_mean, m_d, CENTER, GATE)
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
def bwd_cols(
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
    # bwd_dots, dx needs only its own columns; and walking down a chunk's rows keeps
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
        b_sw, b_sb, b_srs, b_sbs = bwd_block(
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
        # counts itself in on the chunk's counter (zeroed by bwd_dots) once all its rows are
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
