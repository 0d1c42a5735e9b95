"""Triton kernels for the channel norms of (N, C, L) inputs: batch, group and instance norm.

One program normalizes one set, read as [rows, L] blocks of a strided (rows, L) view of x
(L the product of the trailing dims), with a per-channel affine:
- SETS_BATCH (batch norm, training): program c normalizes channel c; its rows are the N
  samples (row stride s_n), all of channel c;
- SETS_GROUP (group norm; instance norm is G = C): program (n, g) normalizes the K = C/G
  channels of group g in sample n; its rows are those channels (row stride s_c), row r
  of channel g*K + r.
The weight and bias are loaded per channel, never repeated per column.

Launches (docs/performance.md, "Launches per call"): one forward, which also updates
batch norm's running buffers (program c owns entry c); backward one for batch norm
(program c owns channel c: it writes dw[c], db[c] in the parameters' dtypes) and for
group norm with N = 1, else two: fp32 partials (N, C) of dw and db, which
`fuseblock.kernels.launch`'s `_bwd_sum` adds up over N.

Each program reads its set twice each way (statistics, then the output or dx): a set
longer than one block does not fit on chip. Blocks are [BR rows, BL columns] of at most
BLOCK elements, BL the whole of L when it fits, so short L (L = 1 for (N, C) inputs)
still fills a block with rows.

Names as in `fuseblock.kernels.norm`: i_ program ids, o_ offsets, m_ masks, b_ blocks
(fp32 in registers). X input, Y output, W weight, B bias, MEAN and RSTD the set
statistics (fp32), RM and RV the running buffers, DY and DX gradients, DW and DB the
parameters' gradients (or their fp32 partials).
"""
# No `from __future__ import annotations`: Triton 3.1's interpreter reads the string
# "tl.constexpr" as no annotation and passes BR, BL, ... as arrays (tests/tools/test_floor.py).

import torch
import triton
import triton.language as tl

from . import launch
from .launch import LAUNCHES, pow2, stride, sum_partial_rows, warps

SETS_BATCH = tl.constexpr(0)  # one set per channel, over the batch
SETS_GROUP = tl.constexpr(1)  # one set per (sample, group of channels)

FWD_BLOCK = 4096  # elements per [BR, BL] block of the forward (read at call time: tests shrink it)
BWD_BLOCK = 2048  # and of the backward, which keeps more blocks live


@triton.jit
def _check_sets(SETS: tl.constexpr):
    tl.static_assert(SETS == SETS_BATCH or SETS == SETS_GROUP, "unknown SETS mode")


@triton.jit
def _div(b_a, n):
    # IEEE division: the default GPU division is approximate (2 ulp)
    return tl.div_rn(b_a, tl.cast(n, tl.float32))


@triton.jit
def _set(i_set, G, K, s_n, s_c, SETS: tl.constexpr):
    """(first element's offset, first channel, row stride) of set i_set, in x's strides."""
    if SETS == SETS_BATCH:
        o_base = i_set * s_c
        ch0 = i_set
        s_row = s_n
    else:
        i_n = i_set // G
        ch0 = (i_set % G) * K
        o_base = i_n * s_n + ch0 * s_c
        s_row = s_c
    return o_base, ch0, s_row


@triton.jit
def _rows_vec(T, s_t, ch0, o_r, m_r):
    """A per-channel vector (weight, bias) for a block of rows that are channels ch0 + o_r."""
    return tl.load(T + (ch0 + o_r) * s_t, mask=m_r, other=0.0).to(tl.float32)


# --------------------------------------------------------------------------- forward
@triton.jit(do_not_specialize=["R", "L", "count", "eps", "mom", "mom_var"])
def _channel_fwd(
    X, W, B, Y, MEAN, RSTD, RM, RV,
    s_n, s_c, s_l, t_n, t_c, s_w, s_b, s_rm, s_rv,
    R, L, G, K, count, eps, mom, mom_var,
    BR: tl.constexpr, BL: tl.constexpr, SETS: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RUN: tl.constexpr,
):
    _check_sets(SETS)
    i_set = tl.program_id(0).to(tl.int64)  # int64: offsets may pass 2**31 (o_l * s_l too: channels_last)
    o_x, ch0, s_row = _set(i_set, G, K, s_n, s_c, SETS)
    o_y, _, t_row = _set(i_set, G, K, t_n, t_c, SETS)  # Y: contiguous (N, C, L), unit column stride
    o_br = tl.arange(0, BR)
    o_bl = tl.arange(0, BL)
    # pass 1: per lane the count, running mean and sum of squared deviations (Welford),
    # merged at the end (Chan et al.) relative to lane (0, 0)'s mean, which holds the set's
    # first element: a constant set's mean is then exact, x - mean = 0 and y = bias.
    b_n = tl.zeros([BR, BL], dtype=tl.float32)
    b_mu = tl.zeros([BR, BL], dtype=tl.float32)
    b_m2 = tl.zeros([BR, BL], dtype=tl.float32)
    for i_r in range(0, R, BR):
        o_r = (i_r + o_br).to(tl.int64)
        for i_l in range(0, L, BL):
            o_l = (i_l + o_bl).to(tl.int64)
            mask = (o_r < R)[:, None] & (o_l < L)[None, :]
            b_x = tl.load(X + o_x + o_r[:, None] * s_row + o_l[None, :] * s_l, mask=mask, other=0.0).to(tl.float32)
            b_n += tl.where(mask, 1.0, 0.0)
            b_d = tl.where(mask, b_x - b_mu, 0.0)
            b_mu += b_d / tl.maximum(b_n, 1.0)
            b_m2 += b_d * (b_x - b_mu)
    b_first = (o_br == 0)[:, None] & (o_bl == 0)[None, :]
    b_mu0 = tl.sum(tl.sum(tl.where(b_first, b_mu, 0.0), 1), 0)
    b_mean = b_mu0 + _div(tl.sum(tl.sum(b_n * (b_mu - b_mu0), 1), 0), count)
    b_dev = b_mu - b_mean
    b_var = _div(tl.sum(tl.sum(b_m2 + b_n * b_dev * b_dev, 1), 0), count)  # biased, as normalized
    b_rstd = tl.rsqrt(b_var + eps)
    tl.store(MEAN + i_set, b_mean)
    tl.store(RSTD + i_set, b_rstd)
    if HAS_RUN:  # batch norm's running buffers: r = (1 - m) r + m s, the variance unbiased (mom_var = m n/(n-1))
        b_rm = tl.load(RM + ch0 * s_rm).to(tl.float32)
        b_rv = tl.load(RV + ch0 * s_rv).to(tl.float32)
        tl.store(RM + ch0 * s_rm, ((1.0 - mom) * b_rm + mom * b_mean).to(RM.dtype.element_ty))
        tl.store(RV + ch0 * s_rv, ((1.0 - mom) * b_rv + mom_var * b_var).to(RV.dtype.element_ty))
    # pass 2: y = (x - mean) * rstd * w[ch] + b[ch], the affine folded into one scale and shift
    if SETS == SETS_BATCH:  # one channel: its scale and shift, once
        b_a = b_rstd * tl.load(W + ch0 * s_w).to(tl.float32) if HAS_W else b_rstd
        b_s = tl.load(B + ch0 * s_b).to(tl.float32) if HAS_B else 0.0
    for i_r in range(0, R, BR):
        o_r = (i_r + o_br).to(tl.int64)
        m_r = o_r < R
        if SETS == SETS_GROUP:  # one channel per row: this block's rows'
            b_a = (b_rstd * _rows_vec(W, s_w, ch0, o_r, m_r) if HAS_W else b_rstd + tl.zeros([BR], tl.float32))[:, None]
            b_s = (_rows_vec(B, s_b, ch0, o_r, m_r) if HAS_B else tl.zeros([BR], tl.float32))[:, None]
        for i_l in range(0, L, BL):
            o_l = (i_l + o_bl).to(tl.int64)
            mask = m_r[:, None] & (o_l < L)[None, :]
            b_x = tl.load(X + o_x + o_r[:, None] * s_row + o_l[None, :] * s_l, mask=mask, other=0.0).to(tl.float32)
            b_y = (b_x - b_mean) * b_a + b_s  # x = mean (a constant set): exactly b
            tl.store(Y + o_y + o_r[:, None] * t_row + o_l[None, :], b_y.to(Y.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- backward
@triton.jit(do_not_specialize=["R", "L", "count", "n_ch"])
def _channel_bwd(
    X, W, MEAN, RSTD, DY, DX, DW, DB,
    s_n, s_c, s_l, u_n, u_c, u_l, t_n, t_c, s_w,
    R, L, G, K, count, n_ch,
    BR: tl.constexpr, BL: tl.constexpr, SETS: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):
    _check_sets(SETS)
    # With x_hat = (x - mean) rstd and g = dy w[ch] (docs/family.md), over the set:
    #   dx = rstd (g - mean(g) - x_hat mean(g x_hat)),  dw[ch] = sum dy x_hat,  db[ch] = sum dy
    # Pass 1 sums dy and dy x_hat per lane: per block of rows for group norm, whose rows
    # are channels (reduced to per-channel sums there, then weighted into the set's sums
    # of g and g x_hat); over the whole set for batch norm, one channel. Pass 2 writes dx.
    i_set = tl.program_id(0).to(tl.int64)
    o_x, ch0, s_row = _set(i_set, G, K, s_n, s_c, SETS)
    o_dy, _, u_row = _set(i_set, G, K, u_n, u_c, SETS)
    o_dx, _, t_row = _set(i_set, G, K, t_n, t_c, SETS)  # DX: contiguous (N, C, L)
    b_mean = tl.load(MEAN + i_set)
    b_rstd = tl.load(RSTD + i_set)
    o_br = tl.arange(0, BR)
    o_bl = tl.arange(0, BL)
    b_sdy = tl.zeros([BR, BL], dtype=tl.float32)  # lanes of sum dy
    b_sdx = tl.zeros([BR, BL], dtype=tl.float32)  # and of sum dy x_hat
    b_sg = tl.zeros([BR], dtype=tl.float32)  # group norm: the set's sum of g, per row slot
    b_sgx = tl.zeros([BR], dtype=tl.float32)  # and of g x_hat
    for i_r in range(0, R, BR):
        o_r = (i_r + o_br).to(tl.int64)
        m_r = o_r < R
        if SETS == SETS_GROUP:  # new rows, new channels: their sums start afresh
            b_sdy = tl.zeros([BR, BL], dtype=tl.float32)
            b_sdx = tl.zeros([BR, BL], dtype=tl.float32)
        for i_l in range(0, L, BL):
            o_l = (i_l + o_bl).to(tl.int64)
            mask = m_r[:, None] & (o_l < L)[None, :]
            b_x = tl.load(X + o_x + o_r[:, None] * s_row + o_l[None, :] * s_l, mask=mask, other=0.0).to(tl.float32)
            b_dy = tl.load(DY + o_dy + o_r[:, None] * u_row + o_l[None, :] * u_l, mask=mask, other=0.0).to(tl.float32)
            b_sdy += b_dy
            b_sdx += b_dy * (tl.where(mask, b_x - b_mean, 0.0) * b_rstd)
        if SETS == SETS_GROUP:
            b_cdy = tl.sum(b_sdy, 1)  # [BR]: the sums of channels ch0 + o_r in this sample
            b_cdx = tl.sum(b_sdx, 1)
            # this sample's share of dw, db: written directly (N = 1), else fp32 partials (N, C)
            o_part = (i_set // G) * n_ch + ch0 + o_r
            if HAS_W:
                tl.store(DW + o_part, b_cdx.to(DW.dtype.element_ty), mask=m_r)
            if HAS_B:
                tl.store(DB + o_part, b_cdy.to(DB.dtype.element_ty), mask=m_r)
            if HAS_W:
                b_wr = _rows_vec(W, s_w, ch0, o_r, m_r)
                b_cdy *= b_wr
                b_cdx *= b_wr
            b_sg += b_cdy
            b_sgx += b_cdx
    if SETS == SETS_BATCH:  # one channel, whole: its sums are dw[c] and db[c]
        b_tdy = tl.sum(tl.sum(b_sdy, 1), 0)
        b_tdx = tl.sum(tl.sum(b_sdx, 1), 0)
        if HAS_W:
            tl.store(DW + ch0, b_tdx.to(DW.dtype.element_ty))
        if HAS_B:
            tl.store(DB + ch0, b_tdy.to(DB.dtype.element_ty))
        if HAS_W:
            b_w = tl.load(W + ch0 * s_w).to(tl.float32)
            b_tdy *= b_w
            b_tdx *= b_w
    else:
        b_tdy = tl.sum(b_sg, 0)
        b_tdx = tl.sum(b_sgx, 0)
    b_c1 = _div(b_tdy, count)  # mean(g)
    b_c2 = _div(b_tdx, count)  # mean(g x_hat)
    for i_r in range(0, R, BR):
        o_r = (i_r + o_br).to(tl.int64)
        m_r = o_r < R
        if SETS == SETS_GROUP and HAS_W:
            b_w = _rows_vec(W, s_w, ch0, o_r, m_r)[:, None]
        for i_l in range(0, L, BL):
            o_l = (i_l + o_bl).to(tl.int64)
            mask = m_r[:, None] & (o_l < L)[None, :]
            b_x = tl.load(X + o_x + o_r[:, None] * s_row + o_l[None, :] * s_l, mask=mask, other=0.0).to(tl.float32)
            b_dy = tl.load(DY + o_dy + o_r[:, None] * u_row + o_l[None, :] * u_l, mask=mask, other=0.0).to(tl.float32)
            b_g = b_dy * b_w if HAS_W else b_dy
            b_dx = (b_g - b_c1 - (b_x - b_mean) * b_rstd * b_c2) * b_rstd
            tl.store(DX + o_dx + o_r[:, None] * t_row + o_l[None, :], b_dx.to(DX.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launchers
def _blocks(rows: int, length: int, block: int) -> tuple[int, int, int]:
    """(BR, BL, warps): BL covers L up to the block, BR fills the rest with rows."""
    bl = min(pow2(length), block)
    br = min(pow2(rows), max(1, block // bl))
    return br, bl, warps(min(256, max(32, br * bl // 8)))


def _geometry(x: torch.Tensor, batch: bool, groups: int):
    """x as a (N, C, L) view (a copy only where the trailing dims cannot be viewed as one),
    and the sets: (x3, n_sets, rows per set, channels per group)."""
    n, n_ch = x.shape[0], x.shape[1]
    x3 = x.reshape(n, n_ch, x.shape[2:].numel())
    if batch:
        return x3, n_ch, n, 1
    k = n_ch // groups
    return x3, n * groups, k, k


@launch.on_device(0)
def channel_norm_fwd(x, weight, bias, batch: bool, groups: int, eps: float,
                     running_mean=None, running_var=None, momentum: float = 0.0):
    """(y shaped like x, contiguous; mean and rstd (n_sets,) fp32). Sets: one per channel
    over the batch (batch), else one per sample and group of C/groups channels. Running
    buffers (batch norm), when given, are updated in place by the same launch. Any
    strides: x's (N, C, L) view and the per-channel vectors' are passed to the kernel."""
    if x.is_cuda and x.get_device() != torch._C._cuda_getDevice():  # launch.on_device
        return launch.on_its_device(channel_norm_fwd, x, locals())
    x3, n_sets, rows, k = _geometry(x, batch, groups)
    n, n_ch, length = x3.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # not a view: users may edit it in place
    y3 = y.view(x3.shape)
    mean = torch.empty((n_sets,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((n_sets,), dtype=torch.float32, device=x.device)
    if y3.numel() > 0:
        has_run = running_mean is not None
        count = rows * length
        mom_var = momentum * count / (count - 1) if has_run else 0.0
        br, bl, warps = _blocks(rows, length, FWD_BLOCK)
        _channel_fwd_ = launch.traced(_channel_fwd) if launch.TRACING.on else _channel_fwd
        _channel_fwd_[(n_sets,)](x3, weight, bias, y3, mean, rstd, running_mean, running_var,
                        *x3.stride(), y3.stride(0), y3.stride(1), stride(weight), stride(bias),
                        stride(running_mean), stride(running_var),
                        rows, length, max(groups, 1), k, float(count), eps, momentum, mom_var,
                        BR=br, BL=bl, SETS=0 if batch else 1, HAS_W=weight is not None, HAS_B=bias is not None,
                        HAS_RUN=has_run, num_warps=warps, **launch.NO_SPILL)
        LAUNCHES["channel_fwd"] += 1
    return y, mean, rstd


@launch.on_device(1)
def channel_norm_bwd(dy, x, weight, bias, mean, rstd, batch: bool, groups: int):
    """(dx in x's dtype, dw in weight's dtype or None, db in bias's dtype or None). One
    launch for batch norm and for N = 1; two otherwise (`_bwd_sum` over the N samples)."""
    if x.is_cuda and x.get_device() != torch._C._cuda_getDevice():  # launch.on_device
        return launch.on_its_device(channel_norm_bwd, x, locals())
    x3, n_sets, rows, k = _geometry(x, batch, groups)
    n, n_ch, length = x3.shape
    dy3 = dy.reshape(x3.shape)
    dev = x.device
    need_dw, need_db = weight is not None, bias is not None
    dx = torch.empty(x.shape, dtype=x.dtype, device=dev)  # as y in channel_norm_fwd
    dx3 = dx.view(x3.shape)
    if dx.numel() == 0:  # no samples, no launch: the sums over none are zero (a fill each)
        return (dx, *(None if t is None else torch.zeros((n_ch,), dtype=t.dtype, device=dev) for t in (weight, bias)))
    dw = torch.empty((n_ch,), dtype=weight.dtype, device=dev) if need_dw else None
    db = torch.empty((n_ch,), dtype=bias.dtype, device=dev) if need_db else None
    # group norm over several samples: each program has one sample's share of a channel
    sum_parts = not batch and n > 1 and (need_dw or need_db)
    dw_part = torch.empty((n, n_ch), dtype=torch.float32, device=dev) if need_dw and sum_parts else dw
    db_part = torch.empty((n, n_ch), dtype=torch.float32, device=dev) if need_db and sum_parts else db
    br, bl, warps = _blocks(rows, length, BWD_BLOCK)
    _channel_bwd_ = launch.traced(_channel_bwd) if launch.TRACING.on else _channel_bwd
    _channel_bwd_[(n_sets,)](x3, weight, mean, rstd, dy3, dx3, dw_part, db_part,
                    *x3.stride(), *dy3.stride(), dx3.stride(0), dx3.stride(1), stride(weight),
                    rows, length, max(groups, 1), k, float(rows * length), n_ch,
                    BR=br, BL=bl, SETS=0 if batch else 1, HAS_W=need_dw, HAS_B=need_db,
                    num_warps=warps)
    LAUNCHES["channel_bwd"] += 1
    if sum_parts:
        sum_partial_rows(dw_part, db_part, dw, db, n, n_ch)
        LAUNCHES["channel_bwd"] += 1
    return dx, dw, db
