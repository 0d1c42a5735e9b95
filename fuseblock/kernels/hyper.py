"""Triton kernels of the hyper-connection (mHC) boundary: one launch forward, two backward.

Per token, streams H (n, d), branch f (d), the math of `fuseblock.hyper_spec`. A program
takes BT tokens at a time; every block below is [BT tokens, NP streams, BD columns] (NP,
MP: n and m rounded up to powers of two, the padding masked to zeros).

Forward (`_fwd`), three passes over the columns of the BT tokens:
1. H' = post (x) f + comb^T H, stored; the sum of squares of flat(H') and the projection
   v = fn . flat(H') as a [BT, NP*BD] x [NP*BD, MP] dot per chunk (fn read once per BT
   tokens); then mix = rho v (stored with rho: what the backward keeps), pre, post', and
   comb' by Sinkhorn in registers ([BT, NP, NP]);
2. z = sum_i pre_i H'_i, rounded to the streams' dtype and stored in y's place, and its
   sum of squares (H' is re-read from the launch's own writes: a cache hit, not traffic);
3. y = z rsqrt(mean(z^2) + eps) w over the stored z.

Backward (`_bwd`, persistent programs, then `_bwd_params`), from H, f, post, comb, H', fn
and the saved mix and rho (no (m, n*d) intermediate):
- pass A: sum z^2, sum g z (g = dy w), and per stream sum g H'_i, sum z H'_i, which give
  dpre_i = <dz, H'_i> with dz = r g - (r^3 <g, z>/d) z, no second pass;
- the coefficients' backward: sigmoid', then (with comb's gradient) the softmax and
  Sinkhorn rerun forward, each pass's [BT, NP] denominators written to the program's
  scratch, and Sinkhorn's backward pass by pass from its last output, each pass's input
  rebuilt as output x denominator; then the softmax's; da (the gradient of the logits,
  (M, m) fp32) stored for `_bwd_params`. Only pre is formed before pass A: what pass A
  and pass C hold live is what limits their registers;
- pass C: dH' = dH'_out + pre (x) dz + fn^T dv + (drho/dx) with dv = rho scale da (fn^T dv
  a dot over KC rows of fn at a time, dv re-read from da), then
  dH = comb dH', df = post^T dH', dpost = <f, dH'_k>, dcomb_jk = <H_j, dH'_k>, and dw's
  partial rows (one per program, added to across its token blocks).
`_bwd_params`: dfn = sum_t dv_t (x) flat(H'_t) as dots over token blocks, dbase and dscale
from da and mix, dw from the partial rows: one launch.
Names: i_ program ids and loop indices, o_ offsets, m_ masks, b_ blocks (fp32 in registers).
"""
# No `from __future__ import annotations`: Triton 3.1's interpreter reads the string
# "tl.constexpr" as no annotation (see fuseblock/kernels/norm.py).

import torch
import triton
import triton.language as tl

from ..hyper_spec import HyperSpec, Mode
from . import launch
from .launch import LAUNCHES, cdiv, fit_per_sm, num_sms, pow2, sum_rows
from .occupancy import learn, programs_per_sm

BT = 16  # tokens per block: the dots' row count (a tl.dot needs >= 16)
# Sized from compiler builds (`scripts/bench.py targets`, no GPU needed): registers, spills and
# shared memory of each kernel at n = 4, 8, 16 and d = 64 to 262144, sm_90, sm_100 and gfx942.
FN_TILE_FWD = 8192  # elements of a [NP*BD, MP] fn tile (the projection's chunk), forward
FN_TILE_BWD = 1024  # and of a [KC_BWD, NP*BD] one backward, whose chunk holds more blocks live
# (2048 spilled 16 B a thread at n = 8 and 16 on sm_90, bf16)
MAX_DOT_K = 512  # NP*BD: the dot's operands pass through shared memory (278 KB at 1024, over sm_90's 227 KB)
ROW_TILE_FWD = 16384  # elements of a [BT, NP, BD2] block of the collapse passes
ROW_TILE_BWD = 8192
KC_BWD = 16  # rows of fn a step of the backward's fn^T dv dot (its K; a dot needs >= 16)
PARAMS_TILE = 8192  # elements of _bwd_params' [MP, BK] dfn accumulator
PROGRAMS_PER_SM = 2
# Deterministic mode: the programs of a wave whatever the GPU (the default, 2 per SM: 264 on
# an H100, 296 on a B200), which fix dw's partial rows and _bwd_params' token splits
DETERMINISTIC_WAVE = 256
MIN_SPLIT_BLOCKS = 32  # token blocks of one of _bwd_params' token splits at least (512 tokens)
# _fwd and _bwd launch with launch.NO_SPILL: left to itself ptxas capped the forward at n = 8
# (fp32, d = 64) at 128 registers, for two programs an SM, and spilled 8 bytes a thread
# _bwd_params takes 8 warps for n = 16 (m = 288 rows of fn, MP = 512): with 4 it needed 255
# registers and 40 bytes of stack a thread on sm_90, with 8 it needs 128 and none


@triton.jit
def _mean(b_sum, count):
    return tl.div_rn(b_sum, tl.cast(count, tl.float32))


@triton.jit
def _softmax_rows(b_l, m_jk):
    """softmax over the last axis of [BT, NP, NP] logits; masked entries 0."""
    b_l = tl.where(m_jk, b_l, float("-inf"))
    b_mx = tl.max(b_l, 2)
    b_mx = tl.where(b_mx == float("-inf"), 0.0, b_mx)
    b_e = tl.exp(b_l - b_mx[:, :, None])
    b_s = tl.sum(b_e, 2)
    return b_e / tl.where(b_s == 0.0, 1.0, b_s)[:, :, None]


@triton.jit
def _sinkhorn(b_s, m_jk, m_ts, iters, hc_eps, DENS, KEEP: tl.constexpr):
    """comb = Sinkhorn(S + hc_eps): a column pass, then (iters - 1) row and column passes,
    each dividing by (sum + hc_eps). m_jk masks [BT, NP, NP], m_ts [BT, NP] (the tokens and
    streams): the padded rows and columns (n not a power of two, the tokens past M) divide
    by 1, so that they stay 0 (0 / hc_eps, and 0 / 0 at hc_eps = 0, would not). KEEP: each
    pass's [BT, NP] denominators go to this program's scratch DENS (pass 0: columns; pass
    2i + 1: rows, 2i + 2: columns) for `_sinkhorn_bwd`. In registers, 2 iters - 1 = 39
    passes of [16, 16] at n = 16 took 64 a thread of 256 (a [BT, 64, NP] block, each pass a
    select over all 64); the scratch stays in L1/L2 (the same program reads it back at once)."""
    BT_: tl.constexpr = b_s.shape[0]
    NP_: tl.constexpr = b_s.shape[1]
    o_den = tl.arange(0, BT_)[:, None] * NP_ + tl.arange(0, NP_)[None, :]
    b_c = tl.where(m_jk, b_s + hc_eps, 0.0)
    b_den = tl.where(m_ts, tl.sum(b_c, 1) + hc_eps, 1.0)  # [BT, NP] per column k; 1 in the padding
    b_c = b_c / b_den[:, None, :]
    if KEEP:
        tl.store(DENS + o_den, b_den)
    for i in range(iters - 1):
        b_den = tl.where(m_ts, tl.sum(b_c, 2) + hc_eps, 1.0)  # per row j
        b_c = b_c / b_den[:, :, None]
        if KEEP:
            tl.store(DENS + (2 * i + 1) * BT_ * NP_ + o_den, b_den)
        b_den = tl.where(m_ts, tl.sum(b_c, 1) + hc_eps, 1.0)
        b_c = b_c / b_den[:, None, :]
        if KEEP:
            tl.store(DENS + (2 * i + 2) * BT_ * NP_ + o_den, b_den)
    return b_c


@triton.jit
def _sinkhorn_bwd(b_c, b_dc, m_jk, iters, DENS):
    """The gradient at the passes' input S + hc_eps, from comb's b_dc: each pass
    Y = X / den backs up as dX = (dY - sum(dY Y)) / den over its axis, and X = Y den
    (den read back from `_sinkhorn`'s scratch, after a barrier). dX is kept 0 outside m_jk:
    a column pass would give a padded row -sum(dY Y), and each row pass multiply it again."""
    BT_: tl.constexpr = b_c.shape[0]
    NP_: tl.constexpr = b_c.shape[1]
    o_den = tl.arange(0, BT_)[:, None] * NP_ + tl.arange(0, NP_)[None, :]
    for q in range(iters - 1):
        i = iters - 2 - q
        b_den = tl.load(DENS + (2 * i + 2) * BT_ * NP_ + o_den)[:, None, :]
        b_dc = tl.where(m_jk, (b_dc - tl.sum(b_dc * b_c, 1)[:, None, :]) / b_den, 0.0)
        b_c = b_c * b_den
        b_den = tl.load(DENS + (2 * i + 1) * BT_ * NP_ + o_den)[:, :, None]
        b_dc = tl.where(m_jk, (b_dc - tl.sum(b_dc * b_c, 2)[:, :, None]) / b_den, 0.0)
        b_c = b_c * b_den
    b_den = tl.load(DENS + o_den)[:, None, :]
    return tl.where(m_jk, (b_dc - tl.sum(b_dc * b_c, 1)[:, None, :]) / b_den, 0.0)


@triton.jit
def _pre(MIX, BASE, SCALE, o_t, m_t, N, m, o_s, m_s, hc_eps, HAS_FN: tl.constexpr):
    """(pre, the sigmoid of its logits) of BT tokens from the stored mix; with no fn, the
    mean (and a zero sigmoid)."""
    m_ts = m_t[:, None] & m_s[None, :]
    if HAS_FN:
        b_a = tl.load(MIX + o_t[:, None] * m + o_s[None, :], mask=m_ts, other=0.0) * tl.load(SCALE).to(tl.float32) \
            + tl.load(BASE + o_s, mask=m_s, other=0.0).to(tl.float32)[None, :]
        b_sg_pre = tl.sigmoid(b_a)
        b_pre = tl.where(m_ts, b_sg_pre + hc_eps, 0.0)
    else:  # the mean
        b_sg_pre = tl.zeros([o_t.shape[0], o_s.shape[0]], dtype=tl.float32)
        b_pre = tl.where(m_ts, 1.0 / tl.cast(N, tl.float32), 0.0)
    return b_pre, b_sg_pre


@triton.jit
def _post_sigmoid(MIX, BASE, SCALE, o_t, m_t, N, m, o_s, m_s):
    """The sigmoid of post's logits, [BT, NP]."""
    b_a = tl.load(MIX + o_t[:, None] * m + N + o_s[None, :], mask=m_t[:, None] & m_s[None, :], other=0.0) \
        * tl.load(SCALE + 1).to(tl.float32) + tl.load(BASE + N + o_s, mask=m_s, other=0.0).to(tl.float32)[None, :]
    return tl.sigmoid(b_a)


@triton.jit
def _comb_softmax(MIX, BASE, SCALE, o_t, m_t, N, m, o_s, m_s):
    """S: the row softmax of comb's logits, [BT, NP, NP], and its mask."""
    m_jk = m_t[:, None, None] & m_s[None, :, None] & m_s[None, None, :]
    o_jk = 2 * N + o_s[:, None] * N + o_s[None, :]
    b_l = tl.load(MIX + o_t[:, None, None] * m + o_jk[None, :, :], mask=m_jk, other=0.0) \
        * tl.load(SCALE + 2).to(tl.float32) + tl.load(BASE + o_jk, mask=m_jk, other=0.0).to(tl.float32)
    return _softmax_rows(b_l, m_jk), m_jk


@triton.jit
def _scales(SCALE, o_m, N, POST_OUT: tl.constexpr, COMB_OUT: tl.constexpr):
    """The scale of each of mix's columns o_m: pre's, post's or comb's (0 past m)."""
    b_sc = tl.where(o_m < N, tl.load(SCALE).to(tl.float32), 0.0)
    if POST_OUT:
        b_sc = tl.where((o_m >= N) & (o_m < 2 * N), tl.load(SCALE + 1).to(tl.float32), b_sc)
    if COMB_OUT:
        b_sc = tl.where(o_m >= 2 * N, tl.load(SCALE + 2).to(tl.float32), b_sc)
    return b_sc


@triton.jit
def _fn_offsets(o_s, o_d, m_s, m_d, D, NP: tl.constexpr, BD: tl.constexpr):
    """fn's column (i d + c) of each (stream i, column c) of a chunk, flattened to [NP*BD]."""
    o_k = tl.reshape(o_s[:, None] * D + o_d[None, :], [NP * BD])
    m_k = tl.reshape(m_s[:, None] & m_d[None, :], [NP * BD])
    return o_k, m_k


# --------------------------------------------------------------------------- forward
@triton.jit(do_not_specialize=["M", "hc_eps", "eps", "post_mult", "post_eps", "iters"])
def _fwd(H, F, POST, COMB, FN, BASE, SCALE, W, Y, HN, POSTN, COMBN, MIX, RHO,
         M, N, D, m, iters, hc_eps, eps, post_mult, post_eps,
         NP: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
         BD2: tl.constexpr, UPDATE: tl.constexpr, COMB_IN: tl.constexpr, HAS_FN: tl.constexpr,
         POST_OUT: tl.constexpr, COMB_OUT: tl.constexpr, HAS_W: tl.constexpr, WEIGHT_LAST: tl.constexpr):
    i_b = tl.program_id(0)
    o_t = (i_b * BT + tl.arange(0, BT)).to(tl.int64)  # int64: M * n * d may pass 2**31
    m_t = o_t < M
    o_s = tl.arange(0, NP)
    m_s = o_s < N
    o_m = tl.arange(0, MP)
    m_m = o_m < m
    K = N * D
    m_ts = m_t[:, None] & m_s[None, :]
    # pass 1: the update, sum of squares and projection of flat(H')
    b_sq = tl.zeros([BT, NP], dtype=tl.float32)
    b_v = tl.zeros([BT, MP], dtype=tl.float32)
    if UPDATE:
        b_post = tl.load(POST + o_t[:, None] * N + o_s[None, :], mask=m_ts, other=0.0).to(tl.float32)
    for i_d in range(0, D, BD):
        o_d = i_d + tl.arange(0, BD)
        m_d = o_d < D
        o_x = o_t[:, None, None] * K + o_s[None, :, None] * D + o_d[None, None, :]
        m_x = m_ts[:, :, None] & m_d[None, None, :]
        if UPDATE:
            m_td = m_t[:, None] & m_d[None, :]
            b_f = tl.load(F + o_t[:, None] * D + o_d[None, :], mask=m_td, other=0.0).to(tl.float32)
            b_x = b_post[:, :, None] * b_f[:, None, :]
            if COMB_IN:
                for j in range(N):  # H'_k += comb_jk H_j: each H_j read once
                    b_cj = tl.load(COMB + o_t[:, None] * N * N + j * N + o_s[None, :], mask=m_ts, other=0.0)
                    b_hj = tl.load(H + o_t[:, None] * K + j * D + o_d[None, :], mask=m_td, other=0.0)
                    b_x += b_cj.to(tl.float32)[:, :, None] * b_hj.to(tl.float32)[:, None, :]
            else:
                b_x += tl.load(H + o_x, mask=m_x, other=0.0).to(tl.float32)
            b_xs = b_x.to(HN.dtype.element_ty)
            tl.store(HN + o_x, b_xs, mask=m_x)
            b_x = b_xs.to(tl.float32)  # the coefficients see the stored H'
        else:
            b_x = tl.load(H + o_x, mask=m_x, other=0.0).to(tl.float32)
        if HAS_FN:
            b_sq += tl.sum(b_x * b_x, 2)
            o_k, m_k = _fn_offsets(o_s, o_d, m_s, m_d, D, NP, BD)
            b_fn = tl.load(FN + o_m[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_m[None, :], other=0.0)
            b_v += tl.dot(tl.reshape(b_x, [BT, NP * BD]), b_fn.to(tl.float32), input_precision="ieee")
    if HAS_FN:
        b_rho = tl.rsqrt(_mean(tl.sum(b_sq, 1), K) + eps)
        tl.store(MIX + o_t[:, None] * m + o_m[None, :], b_v * b_rho[:, None], mask=m_t[:, None] & m_m[None, :])
        tl.store(RHO + o_t, b_rho, mask=m_t)
    tl.debug_barrier()  # mix and H' are read back by other threads of this program
    b_pre, _ = _pre(MIX, BASE, SCALE, o_t, m_t, N, m, o_s, m_s, hc_eps, HAS_FN)
    if POST_OUT:
        b_sg_post = _post_sigmoid(MIX, BASE, SCALE, o_t, m_t, N, m, o_s, m_s)
        tl.store(POSTN + o_t[:, None] * N + o_s[None, :], post_mult * b_sg_post + post_eps, mask=m_ts)
    if COMB_OUT:
        b_S, m_jk = _comb_softmax(MIX, BASE, SCALE, o_t, m_t, N, m, o_s, m_s)
        b_c = _sinkhorn(b_S, m_jk, m_ts, iters, hc_eps, None, False)
        o_c = o_t[:, None, None] * N * N + o_s[None, :, None] * N + o_s[None, None, :]
        tl.store(COMBN + o_c, b_c, mask=m_ts[:, :, None] & m_s[None, None, :])
    # pass 2: z = sum_i pre_i H'_i, rounded and stored in y's place
    SRC = HN if UPDATE else H
    b_zz = tl.zeros([BT, BD2], dtype=tl.float32)
    for i_d in range(0, D, BD2):
        o_d = i_d + tl.arange(0, BD2)
        m_d = o_d < D
        o_x = o_t[:, None, None] * K + o_s[None, :, None] * D + o_d[None, None, :]
        b_x = tl.load(SRC + o_x, mask=m_ts[:, :, None] & m_d[None, None, :], other=0.0).to(tl.float32)
        b_z = tl.sum(b_pre[:, :, None] * b_x, 1).to(H.dtype.element_ty)
        tl.store(Y + o_t[:, None] * D + o_d[None, :], b_z, mask=m_t[:, None] & m_d[None, :])
        b_z = b_z.to(tl.float32)
        b_zz += b_z * b_z
    b_r = tl.rsqrt(_mean(tl.sum(b_zz, 1), D) + eps)
    tl.debug_barrier()
    # pass 3: y = N_w(z)
    for i_d in range(0, D, BD2):
        o_d = i_d + tl.arange(0, BD2)
        m_d = o_d < D
        o_y = o_t[:, None] * D + o_d[None, :]
        m_y = m_t[:, None] & m_d[None, :]
        b_y = tl.load(Y + o_y, mask=m_y, other=0.0).to(tl.float32) * b_r[:, None]
        if WEIGHT_LAST:  # rounded to the streams' dtype, then the weight (y in the promoted dtype)
            b_y = b_y.to(H.dtype.element_ty).to(tl.float32)
        if HAS_W:
            b_y *= tl.load(W + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + o_y, b_y.to(Y.dtype.element_ty), mask=m_y)


# --------------------------------------------------------------------------- backward
@triton.jit(do_not_specialize=["M", "hc_eps", "eps", "post_mult", "post_eps", "iters", "n_prog", "n_cnt"])
def _bwd(H, F, POST, COMB, HN, FN, BASE, SCALE, W, MIX, RHO, DY, DHN, DPOSTN, DCOMBN,
         DH, DF, DPOST, DCOMB, DA, DWP, DENS, CNT,
         M, N, D, m, iters, hc_eps, eps, post_mult, post_eps, n_prog, n_cnt,
         NP: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
         BD2: tl.constexpr, KC: tl.constexpr, UPDATE: tl.constexpr, COMB_IN: tl.constexpr, HAS_FN: tl.constexpr,
         POST_OUT: tl.constexpr, COMB_OUT: tl.constexpr, HAS_W: tl.constexpr,
         HAS_DHN: tl.constexpr, HAS_DPOST: tl.constexpr, HAS_DCOMB: tl.constexpr, ZERO_CNT: tl.constexpr):
    i_p = tl.program_id(0)
    if ZERO_CNT:  # and the n_cnt arrival counters of _bwd_params, which runs next: no launch of their own
        for i_c in range(i_p * BT, n_cnt, n_prog * BT):
            o_c = i_c + tl.arange(0, BT)
            tl.store(CNT + o_c, tl.zeros([BT], dtype=tl.int32), mask=o_c < n_cnt)
    o_s = tl.arange(0, NP)
    m_s = o_s < N
    o_m = tl.arange(0, MP)
    m_m = o_m < m
    K = N * D
    SRC = HN if UPDATE else H
    if COMB_OUT and HAS_DCOMB:
        DENS += i_p.to(tl.int64) * (2 * iters - 1) * BT * NP  # this program's Sinkhorn scratch
    for i_b in range(i_p, tl.cdiv(M, BT), n_prog):
        o_t = (i_b * BT + tl.arange(0, BT)).to(tl.int64)
        m_t = o_t < M
        m_ts = m_t[:, None] & m_s[None, :]
        b_pre, b_sg_pre = _pre(MIX, BASE, SCALE, o_t, m_t, N, m, o_s, m_s, hc_eps, HAS_FN)
        # pass A: the norm's sums, and per stream <g, H'_i>, <z, H'_i>
        b_zz = tl.zeros([BT, BD2], dtype=tl.float32)
        b_gz = tl.zeros([BT, BD2], dtype=tl.float32)
        b_gx = tl.zeros([BT, NP], dtype=tl.float32)
        b_zx = tl.zeros([BT, NP], dtype=tl.float32)
        for i_d in range(0, D, BD2):
            o_d = i_d + tl.arange(0, BD2)
            m_d = o_d < D
            m_td = m_t[:, None] & m_d[None, :]
            o_x = o_t[:, None, None] * K + o_s[None, :, None] * D + o_d[None, None, :]
            b_x = tl.load(SRC + o_x, mask=m_ts[:, :, None] & m_d[None, None, :], other=0.0).to(tl.float32)
            b_z = tl.sum(b_pre[:, :, None] * b_x, 1).to(H.dtype.element_ty).to(tl.float32)
            b_g = tl.load(DY + o_t[:, None] * D + o_d[None, :], mask=m_td, other=0.0).to(tl.float32)
            if HAS_W:
                b_g *= tl.load(W + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
            b_zz += b_z * b_z
            b_gz += b_g * b_z
            b_gx += tl.sum(b_g[:, None, :] * b_x, 2)
            b_zx += tl.sum(b_z[:, None, :] * b_x, 2)
        # 0 past M: at eps = 0 a masked token's rsqrt(0) = inf would make dw's terms 0 * inf
        b_r = tl.where(m_t, tl.rsqrt(_mean(tl.sum(b_zz, 1), D) + eps), 0.0)
        b_k2 = b_r * b_r * b_r * _mean(tl.sum(b_gz, 1), D)  # dz = r g - k2 z
        b_dpre = b_r[:, None] * b_gx - b_k2[:, None] * b_zx
        # the coefficients' backward: the logits' gradient da, stored
        o_row = o_t[:, None] * m
        if HAS_FN:
            b_da = b_dpre * b_sg_pre * (1.0 - b_sg_pre)
            tl.store(DA + o_row + o_s[None, :], b_da, mask=m_ts)
        if POST_OUT:
            if HAS_DPOST:
                b_sg_post = _post_sigmoid(MIX, BASE, SCALE, o_t, m_t, N, m, o_s, m_s)
                b_dq = tl.load(DPOSTN + o_t[:, None] * N + o_s[None, :], mask=m_ts, other=0.0).to(tl.float32)
                b_da = b_dq * post_mult * b_sg_post * (1.0 - b_sg_post)
            else:
                b_da = tl.zeros([BT, NP], dtype=tl.float32)
            tl.store(DA + o_row + N + o_s[None, :], b_da, mask=m_ts)
        if COMB_OUT:
            o_jk = o_s[:, None] * N + o_s[None, :]
            m_jk = m_ts[:, :, None] & m_s[None, None, :]
            if HAS_DCOMB:
                b_S, _ = _comb_softmax(MIX, BASE, SCALE, o_t, m_t, N, m, o_s, m_s)
                b_c = _sinkhorn(b_S, m_jk, m_ts, iters, hc_eps, DENS, True)
                tl.debug_barrier()  # the denominators are read back by other threads
                b_dc = tl.load(DCOMBN + o_t[:, None, None] * N * N + o_jk[None, :, :], mask=m_jk, other=0.0)
                b_dS = _sinkhorn_bwd(b_c, b_dc.to(tl.float32), m_jk, iters, DENS)
                b_dl = b_S * (b_dS - tl.sum(b_dS * b_S, 2)[:, :, None])
            else:
                b_dl = tl.zeros([BT, NP, NP], dtype=tl.float32)
            tl.store(DA + o_row[:, :, None] + 2 * N + o_jk[None, :, :], b_dl, mask=m_jk)
        tl.debug_barrier()  # da is read back whole by other threads
        if HAS_FN:
            m_tm = m_t[:, None] & m_m[None, :]
            b_sc = _scales(SCALE, o_m, N, POST_OUT, COMB_OUT)
            b_dmix = tl.load(DA + o_row + o_m[None, :], mask=m_tm, other=0.0) * b_sc[None, :]
            b_rho = tl.load(RHO + o_t, mask=m_t, other=1.0)
            b_mix = tl.load(MIX + o_row + o_m[None, :], mask=m_tm, other=0.0)
            # rho = (x.x / K + eps)^(-1/2): d rho / dx = -rho^3 x / K, d rho = sum dmix v = sum dmix mix / rho
            b_q = -tl.sum(b_dmix * b_mix, 1) * b_rho * b_rho / tl.cast(K, tl.float32)
        # pass C: dH' and what it gives
        if UPDATE:
            b_post = tl.load(POST + o_t[:, None] * N + o_s[None, :], mask=m_ts, other=0.0).to(tl.float32)
            b_dpost = tl.zeros([BT, NP], dtype=tl.float32)
            b_dcomb = tl.zeros([BT, NP, NP], dtype=tl.float32)
        for i_d in range(0, D, BD):
            o_d = i_d + tl.arange(0, BD)
            m_d = o_d < D
            m_td = m_t[:, None] & m_d[None, :]
            o_x = o_t[:, None, None] * K + o_s[None, :, None] * D + o_d[None, None, :]
            m_x = m_ts[:, :, None] & m_d[None, None, :]
            b_x = tl.load(SRC + o_x, mask=m_x, other=0.0).to(tl.float32)
            b_z = tl.sum(b_pre[:, :, None] * b_x, 1).to(H.dtype.element_ty).to(tl.float32)
            b_dy = tl.load(DY + o_t[:, None] * D + o_d[None, :], mask=m_td, other=0.0).to(tl.float32)
            if HAS_W:
                b_g = b_dy * tl.load(W + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
                b_dw = tl.sum(b_dy * b_z * b_r[:, None], 0)
                o_w = i_p.to(tl.int64) * D + o_d
                if i_b != i_p:  # this program's partial row, added to across its token blocks
                    b_dw += tl.load(DWP + o_w, mask=m_d, other=0.0)
                tl.store(DWP + o_w, b_dw, mask=m_d)
            else:
                b_g = b_dy
            b_dz = b_r[:, None] * b_g - b_k2[:, None] * b_z
            b_dx = b_pre[:, :, None] * b_dz[:, None, :]
            if HAS_DHN:
                b_dx += tl.load(DHN + o_x, mask=m_x, other=0.0).to(tl.float32)
            if HAS_FN:
                o_k, m_k = _fn_offsets(o_s, o_d, m_s, m_d, D, NP, BD)
                # fn^T dv, its m rows KC at a time, dv re-read from da (just written: L1/L2): an
                # fp32 (FMA) dot holds its operands' whole K extent a thread, and [BT, MP] held
                # across the loop spilled 328 B (n = 8) and 2 KB (n = 16) a thread on sm_90
                b_fv = tl.zeros([BT, NP * BD], dtype=tl.float32)
                for i_m in range(0, m, KC):
                    o_mc = i_m + tl.arange(0, KC)
                    m_mc = o_mc < m
                    b_dv = tl.load(DA + o_row + o_mc[None, :], mask=m_t[:, None] & m_mc[None, :], other=0.0) \
                        * _scales(SCALE, o_mc, N, POST_OUT, COMB_OUT)[None, :] * b_rho[:, None]
                    b_fn = tl.load(FN + o_mc[:, None] * K + o_k[None, :], mask=m_mc[:, None] & m_k[None, :],
                                   other=0.0)
                    b_fv += tl.dot(b_dv, b_fn.to(tl.float32), input_precision="ieee")
                b_dx += tl.reshape(b_fv, [BT, NP, BD])
                b_dx += b_q[:, None, None] * b_x
            if UPDATE:
                b_f = tl.load(F + o_t[:, None] * D + o_d[None, :], mask=m_td, other=0.0).to(tl.float32)
                tl.store(DF + o_t[:, None] * D + o_d[None, :], tl.sum(b_post[:, :, None] * b_dx, 1).to(
                    DF.dtype.element_ty), mask=m_td)
                b_dpost += tl.sum(b_f[:, None, :] * b_dx, 2)
                if COMB_IN:
                    for j in range(N):
                        b_cj = tl.load(COMB + o_t[:, None] * N * N + j * N + o_s[None, :], mask=m_ts, other=0.0)
                        b_dhj = tl.sum(b_cj.to(tl.float32)[:, :, None] * b_dx, 1)
                        tl.store(DH + o_t[:, None] * K + j * D + o_d[None, :], b_dhj.to(DH.dtype.element_ty),
                                 mask=m_td)
                        b_hj = tl.load(H + o_t[:, None] * K + j * D + o_d[None, :], mask=m_td, other=0.0)
                        b_dcj = tl.sum(b_hj.to(tl.float32)[:, None, :] * b_dx, 2)  # [BT, k]
                        b_dcomb += tl.where(o_s[None, :, None] == j, b_dcj[:, None, :], 0.0)
                else:
                    tl.store(DH + o_x, b_dx.to(DH.dtype.element_ty), mask=m_x)
            else:
                tl.store(DH + o_x, b_dx.to(DH.dtype.element_ty), mask=m_x)
        if UPDATE:
            tl.store(DPOST + o_t[:, None] * N + o_s[None, :], b_dpost.to(DPOST.dtype.element_ty), mask=m_ts)
            if COMB_IN:
                o_c = o_t[:, None, None] * N * N + o_s[None, :, None] * N + o_s[None, None, :]
                tl.store(DCOMB + o_c, b_dcomb.to(DCOMB.dtype.element_ty), mask=m_ts[:, :, None] & m_s[None, None, :])


@triton.jit
def _scale_sums(DBASE, DSCALE, b_db, b_ds, o_m, m_m, N, POST_OUT: tl.constexpr, COMB_OUT: tl.constexpr):
    """dbase and dscale, in their dtypes, from the [MP] token sums of da and da * mix."""
    tl.store(DBASE + o_m, b_db.to(DBASE.dtype.element_ty), mask=m_m)
    tl.store(DSCALE, tl.sum(tl.where(o_m < N, b_ds, 0.0), 0).to(DSCALE.dtype.element_ty))
    if POST_OUT:
        tl.store(DSCALE + 1, tl.sum(tl.where((o_m >= N) & (o_m < 2 * N), b_ds, 0.0), 0).to(DSCALE.dtype.element_ty))
    if COMB_OUT:
        tl.store(DSCALE + 2, tl.sum(tl.where(o_m >= 2 * N, b_ds, 0.0), 0).to(DSCALE.dtype.element_ty))


@triton.jit(do_not_specialize=["M", "n_part", "n_split", "split_blocks"])
def _bwd_params(SRC, DA, MIX, RHO, SCALE, DFN, DBASE, DSCALE, DWP, DW, PART, CNT,
                M, N, D, m, n_part, n_fn, n_w, n_split, split_blocks,
                MP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr, BR: tl.constexpr,
                HAS_FN: tl.constexpr, POST_OUT: tl.constexpr, COMB_OUT: tl.constexpr, HAS_W: tl.constexpr,
                SPLIT: tl.constexpr):
    # The token sums are split n_split ways, split_blocks token blocks each: programs
    # [0, n_fn * n_split): dfn's column chunk i_p % n_fn over split i_p // n_fn;
    # [.., + n_w): dw's columns from _bwd's partial rows; [.., + n_split): dbase, dscale over
    # a split. SPLIT (n_split > 1): each writes its fp32 sums to PART (dfn's: [n_split, m, K],
    # then dbase's and dscale's: [n_split, 2, MP]) and counts itself in on its sum's counter
    # in CNT (zeroed by _bwd; n_fn for dfn's chunks, then one); the last of the n_split to
    # arrive adds the n_split rows up, in split order: the bits follow n_split, not the
    # order of arrival. Memory order as in the norm's bwd_cols (fuseblock.kernels.norm_wide).
    i_p = tl.program_id(0)
    K = N * D
    o_m = tl.arange(0, MP)
    m_m = o_m < m
    o_tt = tl.arange(0, BT)
    if HAS_FN:
        b_sc = _scales(SCALE, o_m, N, POST_OUT, COMB_OUT)
    if i_p < n_fn * n_split:
        if HAS_FN:
            i_c = i_p % n_fn
            i_s = i_p // n_fn
            o_k = i_c * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_acc = tl.zeros([MP, BK], dtype=tl.float32)
            for i_t in range(i_s * split_blocks * BT, tl.minimum((i_s + 1) * split_blocks * BT, M), BT):
                o_t = (i_t + o_tt).to(tl.int64)
                m_t = o_t < M
                b_da = tl.load(DA + o_t[None, :] * m + o_m[:, None], mask=m_m[:, None] & m_t[None, :], other=0.0)
                b_rho = tl.load(RHO + o_t, mask=m_t, other=0.0)
                b_dv = b_da * b_sc[:, None] * b_rho[None, :]  # [MP, BT]
                b_x = tl.load(SRC + o_t[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
                b_acc += tl.dot(b_dv, b_x.to(tl.float32), input_precision="ieee")
            o_fn = o_m[:, None] * K + o_k[None, :]
            m_fn = m_m[:, None] & m_k[None, :]
            if SPLIT:
                tl.store(PART + i_s.to(tl.int64) * m * K + o_fn, b_acc, mask=m_fn)
                tl.debug_barrier()
                if tl.atomic_add(CNT + i_c, 1, sem="acq_rel", scope="gpu") == n_split - 1:
                    sum_rows(PART, DFN, n_split, m * K, tl.reshape(o_fn, [MP * BK]), tl.reshape(m_fn, [MP * BK]),
                             1, MP * BK)
            else:
                tl.store(DFN + o_fn, b_acc.to(DFN.dtype.element_ty), mask=m_fn)
    elif i_p < n_fn * n_split + n_w:
        if HAS_W:
            o_col = (i_p - n_fn * n_split) * BW + tl.arange(0, BW)
            sum_rows(DWP, DW, n_part, D, o_col, o_col < D, BR, BW)
    else:
        if HAS_FN:
            i_s = i_p - n_fn * n_split - n_w
            b_db = tl.zeros([BT, MP], dtype=tl.float32)
            b_ds = tl.zeros([BT, MP], dtype=tl.float32)
            for i_t in range(i_s * split_blocks * BT, tl.minimum((i_s + 1) * split_blocks * BT, M), BT):
                o_t = (i_t + o_tt).to(tl.int64)
                m_tm = (o_t < M)[:, None] & m_m[None, :]
                b_da = tl.load(DA + o_t[:, None] * m + o_m[None, :], mask=m_tm, other=0.0)
                b_db += b_da
                b_ds += b_da * tl.load(MIX + o_t[:, None] * m + o_m[None, :], mask=m_tm, other=0.0)
            b_db = tl.sum(b_db, 0)
            b_ds = tl.sum(b_ds, 0)
            if SPLIT:
                PART_B = PART + tl.cast(n_split, tl.int64) * m * K  # after dfn's
                tl.store(PART_B + (2 * i_s) * MP + o_m, b_db)
                tl.store(PART_B + (2 * i_s + 1) * MP + o_m, b_ds)
                tl.debug_barrier()
                if tl.atomic_add(CNT + n_fn, 1, sem="acq_rel", scope="gpu") == n_split - 1:
                    o_r = tl.arange(0, BT)
                    b_pb = tl.zeros([BT, MP], dtype=tl.float32)  # the splits' rows, BT at a time
                    b_ps = tl.zeros([BT, MP], dtype=tl.float32)
                    for i_r in range(0, n_split, BT):
                        o_rm = (i_r + o_r)[:, None] * 2 * MP + o_m[None, :]
                        m_r = (i_r + o_r < n_split)[:, None]
                        b_pb += tl.load(PART_B + o_rm, mask=m_r, other=0.0, cache_modifier=".cg")
                        b_ps += tl.load(PART_B + MP + o_rm, mask=m_r, other=0.0, cache_modifier=".cg")
                    _scale_sums(DBASE, DSCALE, tl.sum(b_pb, 0), tl.sum(b_ps, 0), o_m, m_m, N, POST_OUT, COMB_OUT)
            else:
                _scale_sums(DBASE, DSCALE, b_db, b_ds, o_m, m_m, N, POST_OUT, COMB_OUT)


# --------------------------------------------------------------------------- launchers
class _Blocks:
    """The block sizes of one spec: NP, MP, BD (the projection's chunk), BD2."""

    def __init__(self, spec: HyperSpec, fn_tile: int, row_tile: int, fn_rows: int | None = None):
        """fn_rows: rows of fn in one [fn_rows, NP*BD] tile (None: all MP of them)."""
        n, d = spec.n, spec.d
        self.np, self.mp = pow2(n), max(16, pow2(max(spec.m, 1)))
        bd = min(pow2(d), max(1, fn_tile // (self.np * (fn_rows or self.mp))), MAX_DOT_K // self.np)
        self.bd = max(16 // self.np, bd)  # a dot needs K >= 16
        self.bd2 = min(pow2(d), max(16, row_tile // (BT * self.np)))
        self.warps = 8 if self.np * self.bd2 * BT >= 4096 else 4

    def flags(self, spec: HyperSpec, weight) -> dict:
        return dict(NP=self.np, MP=self.mp, BT=BT, BD=self.bd, BD2=self.bd2, UPDATE=spec.update,
                    COMB_IN=spec.comb_in, HAS_FN=spec.mode != Mode.MEAN_HEAD,
                    POST_OUT=spec.mode in (Mode.PRE_POST_COMB, Mode.PRE_POST),
                    COMB_OUT=spec.mode == Mode.PRE_POST_COMB, HAS_W=weight is not None)


def _flat(t: torch.Tensor | None, *shape: int) -> torch.Tensor | None:
    """A contiguous view (M, *shape) (a copy only where t cannot be viewed so)."""
    return None if t is None else t.reshape(-1, *shape).contiguous()


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@launch.on_device(0)
def hyper_fwd(streams, branch, post, comb, fn, base, scale, weight, spec: HyperSpec):
    """Returns (y, new_streams or None, post_next or None, comb_next or None, mix (M, m), rho (M,))."""
    if streams.is_cuda and streams.get_device() != torch._C._cuda_getDevice():  # launch.on_device
        return launch.on_its_device(hyper_fwd, streams, locals())
    n, d, m = spec.n, spec.d, spec.m
    lead = streams.shape[:-2]
    H = _flat(streams, n, d)
    M = H.shape[0]
    dev, acc = streams.device, _acc(streams)
    y = torch.empty(*lead, d, dtype=spec.y_dtype(streams, weight), device=dev)
    hn = torch.empty(streams.shape, dtype=streams.dtype, device=dev) if spec.update else None
    post_out = spec.mode in (Mode.PRE_POST_COMB, Mode.PRE_POST)
    post_n = torch.empty(*lead, n, dtype=acc, device=dev) if post_out else None
    comb_n = torch.empty(*lead, n, n, dtype=acc, device=dev) if spec.mode == Mode.PRE_POST_COMB else None
    mix = torch.empty(M, m, dtype=torch.float32, device=dev)
    rho = torch.empty(M, dtype=torch.float32, device=dev)
    if M > 0:
        blk = _Blocks(spec, FN_TILE_FWD, ROW_TILE_FWD)
        _fwd_ = launch.traced(_fwd) if launch.TRACING.on else _fwd
        _fwd_[(cdiv(M, BT),)](
            H, _flat(branch, d), _flat(post, n), _flat(comb, n, n), _c(fn), _c(base), _c(scale), _c(weight), y, hn,
            post_n, comb_n, mix, rho, M, n, d, m, spec.iters, spec.hc_eps, spec.eps, spec.post_mult, spec.post_eps,
            **blk.flags(spec, weight), WEIGHT_LAST=spec.weight_last and y.dtype != streams.dtype,
            num_warps=blk.warps, **launch.NO_SPILL)
        LAUNCHES["hc_fwd"] += 1
    return y, hn, post_n, comb_n, mix, rho


def _c(t):
    return None if t is None else t.contiguous()


def _new(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized contiguous tensor of t's shape and dtype: the kernels write every
    gradient as contiguous, whatever t's strides (empty_like would keep a permuted t's)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


@launch.on_device(4)
def hyper_bwd(dy, dhn, dpost_n, dcomb_n, streams, branch, post, comb, hn, fn, base, scale, weight, mix, rho,
              spec: HyperSpec):
    """(dstreams, dbranch, dpost, dcomb, dfn, dbase, dscale, dweight), None where the input is None.
    dy, dhn, dpost_n, dcomb_n: the outputs' gradients (None: zero)."""
    if streams.is_cuda and streams.get_device() != torch._C._cuda_getDevice():  # launch.on_device
        return launch.on_its_device(hyper_bwd, streams, locals())
    n, d, m = spec.n, spec.d, spec.m
    H = _flat(streams, n, d)
    M, dev = H.shape[0], streams.device
    has_fn = spec.mode != Mode.MEAN_HEAD
    blk = _Blocks(spec, FN_TILE_BWD, ROW_TILE_BWD, KC_BWD)
    dH = _new(streams)
    df = _new(branch) if spec.update else None
    dpost = _new(post) if spec.update else None
    dcomb = _new(comb) if comb is not None else None
    dfn = _new(fn) if has_fn else None
    dbase = _new(base) if has_fn else None
    dscale = _new(scale) if has_fn else None
    dw = _new(weight) if weight is not None else None
    if M == 0:
        for t in (dfn, dbase, dscale, dw):
            if t is not None:
                t.zero_()
        return dH, df, dpost, dcomb, dfn, dbase, dscale, dw
    if dy is None:
        dy = torch.zeros(*streams.shape[:-2], d, dtype=streams.dtype, device=dev)
    # one wave: the programs the GPU holds at once, or in deterministic mode a count fixed
    # whatever the GPU (dw's partial rows follow it, and so the order of dw's sum)
    wave = DETERMINISTIC_WAVE if launch.deterministic() else num_sms(dev) * PROGRAMS_PER_SM
    n_blocks = cdiv(M, BT)
    n_prog = min(n_blocks, wave)
    flags = blk.flags(spec, weight)
    bk = max(16, PARAMS_TILE // blk.mp)
    n_fn = cdiv(n * d, bk) if has_fn else 0
    bw = max(32, min(pow2(d), 1024))
    n_w = cdiv(d, bw) if weight is not None else 0
    # _bwd_params' token sums split so that dfn's column chunks fill a wave of its own (the
    # programs an SM holds, learned from its first compiled launch; in deterministic mode
    # DETERMINISTIC_WAVE), each split at least MIN_SPLIT_BLOCKS token blocks (its partial sums
    # cost 8 m / (split tokens) bytes per element of H' read, fp32 written and read back)
    p_warps = 8 if blk.mp >= 512 else 4
    p_variant = ("hc_bwd_params", blk.mp, bk, streams.dtype, has_fn, flags["POST_OUT"], flags["COMB_OUT"],
                 weight is not None)
    p_wave = DETERMINISTIC_WAVE if launch.deterministic() else \
        num_sms(dev) * programs_per_sm(dev, p_variant, fit_per_sm(p_warps))
    n_split = max(1, min(cdiv(p_wave, max(n_fn, 1)), n_blocks // MIN_SPLIT_BLOCKS)) if has_fn else 1
    split_blocks = cdiv(n_blocks, n_split)
    n_split = cdiv(n_blocks, split_blocks)  # none empty
    part = torch.empty(n_split * (m * n * d + 2 * blk.mp), dtype=torch.float32, device=dev) if n_split > 1 else None
    cnt = torch.empty(n_fn + 1, dtype=torch.int32, device=dev) if n_split > 1 else None  # zeroed by _bwd
    da = torch.empty(M, m, dtype=torch.float32, device=dev)
    dwp = torch.empty(n_prog, d, dtype=torch.float32, device=dev) if weight is not None else None
    src = _flat(hn if spec.update else streams, n, d)
    # each program's Sinkhorn denominators (2 iters - 1 passes of [BT, NP]), rewritten per token block
    dens = torch.empty(n_prog, 2 * spec.iters - 1, BT, blk.np, dtype=torch.float32, device=dev) \
        if flags["COMB_OUT"] and dcomb_n is not None else None
    _bwd_ = launch.traced(_bwd) if launch.TRACING.on else _bwd
    _bwd_[(n_prog,)](
        H, _flat(branch, d), _flat(post, n), _flat(comb, n, n), src, _c(fn), _c(base), _c(scale), _c(weight), mix, rho,
        _flat(dy, d), _flat(dhn, n, d), _flat(dpost_n, n), _flat(dcomb_n, n, n),
        dH, df, dpost, dcomb, da, dwp, dens, cnt,
        M, n, d, m, spec.iters, spec.hc_eps, spec.eps, spec.post_mult, spec.post_eps, n_prog, n_fn + 1,
        **flags, KC=KC_BWD, HAS_DHN=dhn is not None, HAS_DPOST=dpost_n is not None, HAS_DCOMB=dcomb_n is not None,
        ZERO_CNT=n_split > 1, num_warps=blk.warps, **launch.NO_SPILL)
    _bwd_params_ = launch.traced(_bwd_params) if launch.TRACING.on else _bwd_params
    compiled = _bwd_params_[(n_fn * n_split + n_w + (n_split if has_fn else 0),)](
        src, da, mix, rho, _c(scale), dfn, dbase, dscale, dwp, dw, part, cnt, M, n, d, m, n_prog, n_fn, n_w,
        n_split, split_blocks, MP=blk.mp, BT=BT, BK=bk, BW=bw, BR=max(1, 2048 // bw), HAS_FN=has_fn,
        POST_OUT=flags["POST_OUT"], COMB_OUT=flags["COMB_OUT"], HAS_W=weight is not None, SPLIT=n_split > 1,
        num_warps=p_warps)
    if n_split > 1:  # where the split matters
        learn(dev, p_variant, compiled, p_warps)
    LAUNCHES["hc_bwd"] += 2
    return dH, df, dpost, dcomb, dfn, dbase, dscale, dw
