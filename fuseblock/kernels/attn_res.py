"""Triton kernels of the attention residual (`fuseblock.attn_res_norm`): one launch forward,
two backward.

Per token, S sources v_j (d,): the bank's S - 1 or S rows (any token and source strides,
unit column stride) and, with an update, partial' = partial + branch as the last; the math
of `fuseblock.attn_res_spec`. A program takes BT tokens; every block is [BT tokens, SP
sources, BD columns] (SP: S rounded up to a power of two, the padding masked to zeros).

Forward (`_fwd`), three passes over the columns of its BT tokens:
1. partial' stored (and the stored value used); per source the sum of squares and q . v_j;
   then r_j, the scores and their softmax a, stored with r (what the backward keeps);
2. mixed = sum_j c_j v_j (c = a, or a r with normed values), rounded and stored, and its
   sum of squares; the sources are re-read (the launch's own reads and writes: a cache hit);
3. y = mixed rho w over the stored mixed, rho = rsqrt(mean(mixed^2) + eps) stored.

Backward (`_bwd`, persistent programs, then `launch.sum_partial_rows`), from the sources,
partial', and the saved a, r (M, S) and rho (M,), with dm = rho g - rho^3 <g, m>/d m +
dmixed (g = dy w) and E_j = <dm, v_j>:
- pass A: <g, m>, and per source <g, v_j>, <m, v_j>, <dmixed, v_j>, <q, v_j>: E_j with no
  second pass; da_j = E_j (r_j E_j normed), ds = a (da - <a, da>);
- pass B: dv_j = alpha_j q + beta_j v_j + c_j dm, alpha = scale ds r, beta = -alpha r^2
  <q, v_j>/d (- a r^3 E/d normed); the last source's goes to dpartial (= dbranch) with
  partial's own gradient; dq's (sum_j alpha_j v_j) and dw's (dy m rho) partial rows, one
  per program, added to across its token blocks, then summed by `_bwd_sum`.
Names: i_ program ids and loop indices, o_ offsets, m_ masks, b_ blocks (fp32 in registers).
"""
# No `from __future__ import annotations`: Triton 3.1's interpreter reads the string
# "tl.constexpr" as no annotation (see fuseblock/kernels/norm.py).

import torch
import triton
import triton.language as tl

from ..attn_res_spec import AttnResSpec
from . import launch
from .launch import LAUNCHES, cdiv, num_sms, pow2

TILE_FWD = 8192  # elements of a [BT, SP, BD] block, forward
TILE_BWD = 4096  # and backward, which holds more blocks live
MAX_BT = 16  # tokens a program at most
PROGRAMS_PER_SM = 4  # the backward's persistent programs
# and at least this many tokens each: the dq and dw partial rows (fp32, written and summed)
# cost 16 d bytes a program, next to (2S + 2) d a token of bf16 activations
MIN_TOKENS_PER_PROGRAM = 8


@triton.jit
def _mean(b_sum, count):
    return tl.div_rn(b_sum, tl.cast(count, tl.float32))


@triton.jit
def _sources(SRC, PN, o_t, m_t, o_s, o_d, m_d, NB, D, s_t, s_s, UPDATE: tl.constexpr):
    """The [BT, SP, BD] block of the sources: the bank's rows, and partial' (stored) as row NB."""
    m_x = m_t[:, None, None] & (o_s < NB)[None, :, None] & m_d[None, None, :]
    b_v = tl.load(SRC + o_t[:, None, None] * s_t + o_s[None, :, None] * s_s + o_d[None, None, :], mask=m_x,
                  other=0.0).to(tl.float32)
    if UPDATE:
        b_p = tl.load(PN + o_t[:, None] * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0)
        b_v = tl.where((o_s == NB)[None, :, None], b_p.to(tl.float32)[:, None, :], b_v)
    return b_v


# --------------------------------------------------------------------------- forward
@triton.jit(do_not_specialize=["M", "s_t", "s_s", "scale", "key_eps", "eps"])
def _fwd(SRC, P, BR, Q, W, Y, MIX, PN, A, R, RHO, M, S, NB, D, s_t, s_s, scale, key_eps, eps,
         SP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, UPDATE: tl.constexpr, HAS_P: tl.constexpr,
         NORMED: tl.constexpr, HAS_W: tl.constexpr):
    i_b = tl.program_id(0)
    o_t = (i_b * BT + tl.arange(0, BT)).to(tl.int64)  # int64: M * S * d may pass 2**31
    m_t = o_t < M
    o_s = tl.arange(0, SP)
    m_ts = m_t[:, None] & (o_s < S)[None, :]
    # pass 1: partial', and per source the sum of squares and q . v_j
    b_sq = tl.zeros([BT, SP], dtype=tl.float32)
    b_qv = tl.zeros([BT, SP], dtype=tl.float32)
    for i_d in range(0, D, BD):
        o_d = i_d + tl.arange(0, BD)
        m_d = o_d < D
        if UPDATE:
            o_r = o_t[:, None] * D + o_d[None, :]
            m_r = m_t[:, None] & m_d[None, :]
            b_p = tl.load(BR + o_r, mask=m_r, other=0.0).to(tl.float32)
            if HAS_P:
                b_p += tl.load(P + o_r, mask=m_r, other=0.0).to(tl.float32)
            b_p = b_p.to(PN.dtype.element_ty)
            tl.store(PN + o_r, b_p, mask=m_r)
        b_v = _sources(SRC, PN, o_t, m_t, o_s, o_d, m_d, NB, D, s_t, s_s, False)
        if UPDATE:  # the scores see the stored partial'
            b_v = tl.where((o_s == NB)[None, :, None], b_p.to(tl.float32)[:, None, :], b_v)
        b_q = tl.load(Q + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_sq += tl.sum(b_v * b_v, 2)
        b_qv += tl.sum(b_v * b_q[None, None, :], 2)
    b_r = tl.rsqrt(_mean(b_sq, D) + key_eps)
    b_s = tl.where((o_s < S)[None, :], scale * (b_r * b_qv), float("-inf"))  # padded tokens stay finite
    b_e = tl.exp(b_s - tl.max(b_s, 1)[:, None])
    b_a = b_e / tl.sum(b_e, 1)[:, None]
    o_a = o_t[:, None] * S + o_s[None, :]
    tl.store(A + o_a, b_a, mask=m_ts)
    tl.store(R + o_a, b_r, mask=m_ts)
    b_c = b_a * b_r if NORMED else b_a  # each source's coefficient in the mix
    # pass 2: mixed, rounded and stored, and its sum of squares
    tl.debug_barrier()  # partial' is read back by other threads
    b_mm = tl.zeros([BT, BD], dtype=tl.float32)
    for i_d in range(0, D, BD):
        o_d = i_d + tl.arange(0, BD)
        m_d = o_d < D
        b_v = _sources(SRC, PN, o_t, m_t, o_s, o_d, m_d, NB, D, s_t, s_s, UPDATE)
        b_m = tl.sum(b_c[:, :, None] * b_v, 1).to(MIX.dtype.element_ty)
        tl.store(MIX + o_t[:, None] * D + o_d[None, :], b_m, mask=m_t[:, None] & m_d[None, :])
        b_m = b_m.to(tl.float32)
        b_mm += b_m * b_m
    b_rho = tl.rsqrt(_mean(tl.sum(b_mm, 1), D) + eps)
    tl.store(RHO + o_t, b_rho, mask=m_t)
    tl.debug_barrier()  # mixed is read back by other threads
    # pass 3: y = N_w(mixed)
    for i_d in range(0, D, BD):
        o_d = i_d + tl.arange(0, BD)
        m_d = o_d < D
        o_y = o_t[:, None] * D + o_d[None, :]
        m_y = m_t[:, None] & m_d[None, :]
        b_y = tl.load(MIX + o_y, mask=m_y, other=0.0).to(tl.float32) * b_rho[:, None]
        if HAS_W:
            b_y *= tl.load(W + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + o_y, b_y.to(Y.dtype.element_ty), mask=m_y)


# --------------------------------------------------------------------------- backward
@triton.jit
def _mixed_and_g(b_c, b_v, DY, W, o_t, m_t, o_d, m_d, D, HAS_W: tl.constexpr):
    """(mixed as stored, recomputed; dy; g = dy w) of a [BT, BD] chunk."""
    b_m = tl.sum(b_c[:, :, None] * b_v, 1).to(DY.dtype.element_ty).to(tl.float32)
    b_dy = tl.load(DY + o_t[:, None] * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    b_g = b_dy
    if HAS_W:
        b_g = b_dy * tl.load(W + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    return b_m, b_dy, b_g


@triton.jit(do_not_specialize=["M", "s_t", "s_s", "scale", "n_prog"])
def _bwd(SRC, PN, Q, W, A, R, RHO, DY, DMIX, DPN, DSRC, DP, DQP, DWP, M, S, NB, D, s_t, s_s, scale, n_prog,
         SP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, UPDATE: tl.constexpr, NORMED: tl.constexpr,
         HAS_W: tl.constexpr, HAS_DMIX: tl.constexpr, HAS_DPN: tl.constexpr):
    i_p = tl.program_id(0)
    o_s = tl.arange(0, SP)
    for i_b in range(i_p, tl.cdiv(M, BT), n_prog):
        o_t = (i_b * BT + tl.arange(0, BT)).to(tl.int64)
        m_t = o_t < M
        m_ts = m_t[:, None] & (o_s < S)[None, :]
        o_a = o_t[:, None] * S + o_s[None, :]
        b_a = tl.load(A + o_a, mask=m_ts, other=0.0)
        b_r = tl.load(R + o_a, mask=m_ts, other=0.0)
        b_rho = tl.load(RHO + o_t, mask=m_t, other=0.0)
        b_c = b_a * b_r if NORMED else b_a
        # pass A: <g, m>, and per source <g, v_j>, <m, v_j>, <dmixed, v_j>, <q, v_j>
        b_gm = tl.zeros([BT, BD], dtype=tl.float32)
        b_gv = tl.zeros([BT, SP], dtype=tl.float32)
        b_mv = tl.zeros([BT, SP], dtype=tl.float32)
        b_xv = tl.zeros([BT, SP], dtype=tl.float32)
        b_qv = tl.zeros([BT, SP], dtype=tl.float32)
        for i_d in range(0, D, BD):
            o_d = i_d + tl.arange(0, BD)
            m_d = o_d < D
            b_v = _sources(SRC, PN, o_t, m_t, o_s, o_d, m_d, NB, D, s_t, s_s, UPDATE)
            b_m, _, b_g = _mixed_and_g(b_c, b_v, DY, W, o_t, m_t, o_d, m_d, D, HAS_W)
            b_gm += b_g * b_m
            b_gv += tl.sum(b_g[:, None, :] * b_v, 2)
            b_mv += tl.sum(b_m[:, None, :] * b_v, 2)
            if HAS_DMIX:
                b_x = tl.load(DMIX + o_t[:, None] * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0)
                b_xv += tl.sum(b_x.to(tl.float32)[:, None, :] * b_v, 2)
            b_q = tl.load(Q + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_qv += tl.sum(b_q[None, None, :] * b_v, 2)
        b_k = b_rho * b_rho * b_rho * _mean(tl.sum(b_gm, 1), D)  # dm = rho g - k m + dmixed
        b_E = b_rho[:, None] * b_gv - b_k[:, None] * b_mv + b_xv  # <dm, v_j>
        b_da = b_r * b_E if NORMED else b_E
        b_ds = b_a * (b_da - tl.sum(b_a * b_da, 1)[:, None])
        b_alpha = scale * b_ds * b_r
        b_beta = -_mean(b_alpha * b_r * b_r * b_qv, D)
        if NORMED:
            b_beta -= _mean(b_a * b_r * b_r * b_r * b_E, D)
        # pass B: the sources' gradients, dq's and dw's partial rows
        for i_d in range(0, D, BD):
            o_d = i_d + tl.arange(0, BD)
            m_d = o_d < D
            m_td = m_t[:, None] & m_d[None, :]
            o_r = o_t[:, None] * D + o_d[None, :]
            b_v = _sources(SRC, PN, o_t, m_t, o_s, o_d, m_d, NB, D, s_t, s_s, UPDATE)
            b_m, b_dy, b_g = _mixed_and_g(b_c, b_v, DY, W, o_t, m_t, o_d, m_d, D, HAS_W)
            b_dm = b_rho[:, None] * b_g - b_k[:, None] * b_m
            if HAS_DMIX:
                b_dm += tl.load(DMIX + o_r, mask=m_td, other=0.0).to(tl.float32)
            b_q = tl.load(Q + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_dv = b_alpha[:, :, None] * b_q[None, None, :] + b_beta[:, :, None] * b_v \
                + b_c[:, :, None] * b_dm[:, None, :]
            m_x = m_t[:, None, None] & (o_s < NB)[None, :, None] & m_d[None, None, :]
            o_x = o_t[:, None, None] * (NB * D) + o_s[None, :, None] * D + o_d[None, None, :]
            tl.store(DSRC + o_x, b_dv.to(DSRC.dtype.element_ty), mask=m_x)
            if UPDATE:
                b_dp = tl.sum(tl.where((o_s == NB)[None, :, None], b_dv, 0.0), 1)
                if HAS_DPN:
                    b_dp += tl.load(DPN + o_r, mask=m_td, other=0.0).to(tl.float32)
                tl.store(DP + o_r, b_dp.to(DP.dtype.element_ty), mask=m_td)
            o_w = i_p.to(tl.int64) * D + o_d
            b_dq = tl.sum(tl.sum(b_alpha[:, :, None] * b_v, 1), 0)
            if i_b != i_p:  # this program's partial rows, added to across its token blocks
                b_dq += tl.load(DQP + o_w, mask=m_d, other=0.0)
            tl.store(DQP + o_w, b_dq, mask=m_d)
            if HAS_W:
                b_dw = tl.sum(b_dy * b_m * b_rho[:, None], 0)
                if i_b != i_p:
                    b_dw += tl.load(DWP + o_w, mask=m_d, other=0.0)
                tl.store(DWP + o_w, b_dw, mask=m_d)


# --------------------------------------------------------------------------- launchers
def _blocks(spec: AttnResSpec, tile: int) -> tuple[int, int, int, int]:
    """(SP, BT, BD, warps) of one spec: BD columns of SP sources for BT tokens in `tile` elements."""
    sp = pow2(spec.s)
    bd = min(pow2(spec.d), max(16, tile // sp))
    bt = max(1, min(MAX_BT, tile // (sp * bd)))
    return sp, bt, bd, 8 if sp * bt * bd >= 8192 else 4


def _bank(sources: torch.Tensor, nb: int, d: int) -> tuple[torch.Tensor, int, int]:
    """(bank (M, nb, d), token stride, source stride): a view where sources' leading dims
    merge and its columns are unit-stride, else a contiguous copy."""
    bank = sources.reshape(-1, nb, d)
    if bank.stride(-1) != 1 and d > 1:
        bank = bank.contiguous()
    return bank, bank.stride(0), bank.stride(1)


def _rows(t: torch.Tensor | None, d: int) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1, d).contiguous()


@launch.on_device(0)
def attn_res_fwd(sources, partial, branch, query, weight, spec: AttnResSpec):
    """Returns (y, mixed, partial' or None, a (M, S), r (M, S), rho (M,)), the last three fp32."""
    if sources.is_cuda and sources.get_device() != torch._C._cuda_getDevice():  # launch.on_device
        return launch.on_its_device(attn_res_fwd, sources, locals())
    s, nb, d = spec.s, spec.bank, spec.d
    lead = sources.shape[:-2]
    bank, s_t, s_s = _bank(sources, nb, d)
    M, dev, dtype = bank.shape[0], sources.device, sources.dtype
    y = torch.empty(*lead, d, dtype=dtype, device=dev)
    mixed = torch.empty(*lead, d, dtype=dtype, device=dev)
    pn = torch.empty(*lead, d, dtype=dtype, device=dev) if spec.update else None
    a = torch.empty(M, s, dtype=torch.float32, device=dev)
    r = torch.empty(M, s, dtype=torch.float32, device=dev)
    rho = torch.empty(M, dtype=torch.float32, device=dev)
    if M > 0:
        sp, bt, bd, warps = _blocks(spec, TILE_FWD)
        _fwd_ = launch.traced(_fwd) if launch.TRACING.on else _fwd
        _fwd_[(cdiv(M, bt),)](
            bank, _rows(partial, d), _rows(branch, d), launch.vec(query), launch.vec(weight), y, mixed, pn, a, r, rho,
            M, s, nb, d, s_t, s_s, spec.scale, spec.key_eps, spec.eps, SP=sp, BT=bt, BD=bd, UPDATE=spec.update,
            HAS_P=partial is not None, NORMED=spec.normed_values, HAS_W=weight is not None, num_warps=warps,
            **launch.NO_SPILL)
        LAUNCHES["attn_res_fwd"] += 1
    return y, mixed, pn, a, r, rho


@launch.on_device(3)
def attn_res_bwd(dy, dmixed, dpn, sources, pn, query, weight, a, r, rho, spec: AttnResSpec):
    """(dsources, dpartial (= dbranch) or None, dquery, dweight or None). dy, dmixed, dpn:
    the outputs' gradients (None: zero)."""
    if sources.is_cuda and sources.get_device() != torch._C._cuda_getDevice():  # launch.on_device
        return launch.on_its_device(attn_res_bwd, sources, locals())
    s, nb, d = spec.s, spec.bank, spec.d
    bank, s_t, s_s = _bank(sources, nb, d)
    M, dev = bank.shape[0], sources.device
    dsrc = torch.empty(sources.shape, dtype=sources.dtype, device=dev)
    dp = torch.empty(pn.shape, dtype=pn.dtype, device=dev) if spec.update else None
    dq = torch.empty(query.shape, dtype=query.dtype, device=dev)
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if weight is not None else None
    if M == 0:
        dq.zero_()
        if dw is not None:
            dw.zero_()
        return dsrc, dp, dq, dw
    if dy is None:
        dy = torch.zeros(*sources.shape[:-2], d, dtype=sources.dtype, device=dev)
    sp, bt, bd, warps = _blocks(spec, TILE_BWD)
    per = launch.DETERMINISTIC_PROGRAMS if launch.deterministic() else num_sms(dev) * PROGRAMS_PER_SM
    n_prog = max(1, min(cdiv(M, bt), cdiv(M, MIN_TOKENS_PER_PROGRAM), per))
    dqp = torch.empty(n_prog, d, dtype=torch.float32, device=dev)
    dwp = torch.empty(n_prog, d, dtype=torch.float32, device=dev) if weight is not None else None
    _bwd_ = launch.traced(_bwd) if launch.TRACING.on else _bwd
    _bwd_[(n_prog,)](
        bank, pn, launch.vec(query), launch.vec(weight), a, r, rho, _rows(dy, d), _rows(dmixed, d), _rows(dpn, d),
        dsrc, dp, dqp, dwp, M, s, nb, d, s_t, s_s, spec.scale, n_prog, SP=sp, BT=bt, BD=bd, UPDATE=spec.update,
        NORMED=spec.normed_values, HAS_W=weight is not None, HAS_DMIX=dmixed is not None, HAS_DPN=dpn is not None,
        num_warps=warps, **launch.NO_SPILL)
    launch.sum_partial_rows(dwp, dqp, dw, dq, n_prog, d)
    LAUNCHES["attn_res_bwd"] += 2
    return dsrc, dp, dq, dw
