"""Triton kernels for the embedding norms y = x / max(n(x), eps) over the last dim.

n is sum|x| (ORD_L1, "l1"), sqrt(x.x) (ORD_L2, "l2") or max|x| (ORD_MAX, "max").
Same two layouts and names as `fuseblock.kernels.norm`, by the same rule
(`fuseblock.kernels.launch`):
- `tile`: a [BR rows, BD columns] block, many whole rows per program, for rows that
  fit (MAX_TILE_FWD / MAX_TILE_BWD).
- `loop`: one row per program, looping over column chunks of BD, for wide rows.
Names: i_ program ids, o_ offsets, m_ masks, b_ blocks (fp32 in registers); X input,
O output, N row norms, DO and DX their gradients.

The forward saves only the per-row norm n (fp32); the backward re-reads x. With
D = max(n, eps), a = [n >= eps] (the clamp passes the gradient on equality, as
torch's clamp_min does) and dn/dx = y (l2), sign(x) (l1), sign(x)*[|x| = n]/k (max, the
gradient shared by the k tied entries, as torch's amax and inf-norm do):

    dx = (g - a * (g.x / D) * dn/dx) / D          (for l2, dn/dx = x/D when a = 1)
"""
# No `from __future__ import annotations`: Triton 3.1's interpreter reads the string
# "tl.constexpr" as no annotation and passes BR, BD, ... as arrays (tests/tools/test_floor.py).

import torch
import triton
import triton.language as tl

from ..spec import Ord
from . import launch
from .launch import LAUNCHES, bwd_layout, cdiv, fwd_layout, nan_max, rows

ORD_L1 = tl.constexpr(int(Ord.L1))
ORD_L2 = tl.constexpr(int(Ord.L2))
ORD_MAX = tl.constexpr(int(Ord.MAX))


@triton.jit
def _check_ord(ORD: tl.constexpr):
    tl.static_assert(ORD == ORD_L1 or ORD == ORD_L2 or ORD == ORD_MAX, "unknown ORD")


@triton.jit
def _row_norm(b_x, ORD: tl.constexpr):
    """n of each row of a [BR, BD] block. Masked lanes hold 0, which none of the three sees."""
    if ORD == ORD_L1:
        b_n = tl.sum(tl.abs(b_x), 1)
    elif ORD == ORD_L2:
        b_n = tl.sqrt_rn(tl.sum(b_x * b_x, 1))
    else:
        b_n = nan_max(tl.abs(b_x), 1)
    return b_n


@triton.jit
def _recip(b_n, eps):
    # 1 / max(n, eps) with IEEE division: the default GPU division is approximate (2 ulp)
    # NaN propagates (torch's clamp_min keeps it): the default maximum drops it on a GPU
    return tl.div_rn(tl.zeros_like(b_n) + 1.0, tl.maximum(b_n, eps, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _sign(b_x):
    return tl.where(b_x > 0, 1.0, tl.where(b_x < 0, -1.0, 0.0))


# --------------------------------------------------------------------------- forward
@triton.jit(do_not_specialize=["M", "eps"])
def _fwd_tile(X, O, N, s_x, s_o, M, D, eps, BR: tl.constexpr, BD: tl.constexpr, ORD: tl.constexpr):
    _check_ord(ORD)
    i_m = tl.program_id(0)
    o_m = (i_m * BR + tl.arange(0, BR)).to(tl.int64)  # int64: M * stride may pass 2**31
    o_d = tl.arange(0, BD)
    m_m = o_m < M
    mask = m_m[:, None] & (o_d[None, :] < D)
    b_x = tl.load(X + o_m[:, None] * s_x + o_d[None, :], mask=mask, other=0.0).to(tl.float32)
    b_n = _row_norm(b_x, ORD)  # [BR]
    b_o = b_x * _recip(b_n, eps)[:, None]
    tl.store(O + o_m[:, None] * s_o + o_d[None, :], b_o.to(O.dtype.element_ty), mask=mask)
    tl.store(N + o_m, b_n, mask=m_m)


@triton.jit(do_not_specialize=["eps"])
def _fwd_loop(X, O, N, s_x, s_o, D, eps, BD: tl.constexpr, ORD: tl.constexpr):
    _check_ord(ORD)
    # pass 1 reduces the row chunk by chunk, pass 2 re-reads it (from cache on a GPU)
    i_m = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    b_acc = tl.zeros([BD], dtype=tl.float32)  # per-lane partial sums, or maxima for ORD_MAX
    for i_d in range(0, D, BD):
        m_d = i_d + o_d < D
        b_x = tl.load(X + i_m * s_x + i_d + o_d, mask=m_d, other=0.0).to(tl.float32)
        if ORD == ORD_L1:
            b_acc += tl.abs(b_x)
        elif ORD == ORD_L2:
            b_acc += b_x * b_x
        else:
            b_acc = tl.maximum(b_acc, tl.abs(b_x), propagate_nan=tl.PropagateNan.ALL)
    b_n = nan_max(b_acc, 0) if ORD == ORD_MAX else tl.sum(b_acc, 0)
    if ORD == ORD_L2:
        b_n = tl.sqrt_rn(b_n)
    b_r = _recip(b_n, eps)
    for i_d in range(0, D, BD):
        m_d = i_d + o_d < D
        b_x = tl.load(X + i_m * s_x + i_d + o_d, mask=m_d, other=0.0).to(tl.float32)
        tl.store(O + i_m * s_o + i_d + o_d, (b_x * b_r).to(O.dtype.element_ty), mask=m_d)
    tl.store(N + i_m, b_n)


# --------------------------------------------------------------------------- backward
@triton.jit(do_not_specialize=["M", "eps"])
def _bwd_tile(X, N, DO, DX, s_x, s_do, s_dx, M, D, eps, BR: tl.constexpr, BD: tl.constexpr, ORD: tl.constexpr):
    _check_ord(ORD)
    i_m = tl.program_id(0)
    o_m = (i_m * BR + tl.arange(0, BR)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_m = o_m < M
    mask = m_m[:, None] & (o_d[None, :] < D)
    b_x = tl.load(X + o_m[:, None] * s_x + o_d[None, :], mask=mask, other=0.0).to(tl.float32)
    b_g = tl.load(DO + o_m[:, None] * s_do + o_d[None, :], mask=mask, other=0.0).to(tl.float32)
    b_n = tl.load(N + o_m, mask=m_m, other=1.0)
    b_r = _recip(b_n, eps)  # 1/D
    # c = a * (g.x) / D: the clamped rows (n < eps) scale by 1/eps and stop there
    b_c = tl.where(b_n >= eps, tl.sum(b_g * b_x, 1) * b_r, 0.0)[:, None]
    if ORD == ORD_L1:
        b_t = _sign(b_x)
    elif ORD == ORD_L2:
        b_t = b_x * b_r[:, None]
    else:
        b_top = (tl.abs(b_x) == b_n[:, None]) & mask
        b_k = tl.sum(b_top.to(tl.float32), 1)  # ties share the gradient
        b_t = tl.where(b_top, _sign(b_x), 0.0) / tl.maximum(b_k, 1.0)[:, None]
    b_dx = (b_g - b_c * b_t) * b_r[:, None]
    tl.store(DX + o_m[:, None] * s_dx + o_d[None, :], b_dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["eps"])
def _bwd_loop(X, N, DO, DX, s_x, s_do, s_dx, D, eps, BD: tl.constexpr, ORD: tl.constexpr):
    _check_ord(ORD)
    # pass 1: g.x (and the tie count for max); pass 2: dx
    i_m = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    b_n = tl.load(N + i_m)
    b_r = _recip(b_n, eps)
    b_gx = tl.zeros([BD], dtype=tl.float32)
    b_k = tl.zeros([BD], dtype=tl.float32)
    for i_d in range(0, D, BD):
        m_d = i_d + o_d < D
        b_x = tl.load(X + i_m * s_x + i_d + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_g = tl.load(DO + i_m * s_do + i_d + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_gx += b_g * b_x
        if ORD == ORD_MAX:
            b_k += ((tl.abs(b_x) == b_n) & m_d).to(tl.float32)
    b_c = tl.where(b_n >= eps, tl.sum(b_gx, 0) * b_r, 0.0)
    if ORD == ORD_MAX:
        b_c = b_c / tl.maximum(tl.sum(b_k, 0), 1.0)
    for i_d in range(0, D, BD):
        m_d = i_d + o_d < D
        b_x = tl.load(X + i_m * s_x + i_d + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_g = tl.load(DO + i_m * s_do + i_d + o_d, mask=m_d, other=0.0).to(tl.float32)
        if ORD == ORD_L1:
            b_t = _sign(b_x)
        elif ORD == ORD_L2:
            b_t = b_x * b_r
        else:
            b_t = tl.where(tl.abs(b_x) == b_n, _sign(b_x), 0.0)
        b_dx = (b_g - b_c * b_t) * b_r
        tl.store(DX + i_m * s_dx + i_d + o_d, b_dx.to(DX.dtype.element_ty), mask=m_d)


# --------------------------------------------------------------------------- launchers
@launch.on_device(0)
def embed_norm_fwd(x: torch.Tensor, ord: int, eps: float):
    """Returns (y shaped like x, n shaped x.shape[:-1] in fp32)."""
    if x.is_cuda and x.get_device() != torch._C._cuda_getDevice():  # launch.on_device
        return launch.on_its_device(embed_norm_fwd, x, locals())
    d = x.shape[-1]
    x2 = rows(x, d)
    M = x2.shape[0]
    # outputs in their final shapes, the kernel writing through views (see kernels.norm.norm_fwd)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if M > 0:
        lay = fwd_layout(d)
        y2 = y.view(M, d)
        args = (x2, y2, n.view(M), x2.stride(0), y2.stride(0))
        if lay.tile:
            _fwd_tile_ = launch.traced(_fwd_tile) if launch.TRACING.on else _fwd_tile
            _fwd_tile_[(cdiv(M, lay.br),)](*args, M, d, eps, BR=lay.br, BD=lay.bd, ORD=int(ord), num_warps=lay.warps)
        else:
            _fwd_loop_ = launch.traced(_fwd_loop) if launch.TRACING.on else _fwd_loop
            _fwd_loop_[(M,)](*args, d, eps, BD=lay.bd, ORD=int(ord), num_warps=lay.warps)
        LAUNCHES["embed_fwd"] += 1
    return y, n


@launch.on_device(1)
def embed_norm_bwd(dy: torch.Tensor, x: torch.Tensor, n: torch.Tensor, ord: int, eps: float) -> torch.Tensor:
    """dx in x's dtype, from the saved x and row norms n."""
    if x.is_cuda and x.get_device() != torch._C._cuda_getDevice():  # launch.on_device
        return launch.on_its_device(embed_norm_bwd, x, locals())
    d = x.shape[-1]
    x2, do2 = rows(x, d), rows(dy, d)
    M = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if M > 0:
        lay = bwd_layout(d)
        dx2 = dx.view(M, d)
        args = (x2, n.reshape(M), do2, dx2, x2.stride(0), do2.stride(0), dx2.stride(0))
        if lay.tile:
            _bwd_tile_ = launch.traced(_bwd_tile) if launch.TRACING.on else _bwd_tile
            _bwd_tile_[(cdiv(M, lay.br),)](*args, M, d, eps, BR=lay.br, BD=lay.bd, ORD=int(ord), num_warps=lay.warps)
        else:
            _bwd_loop_ = launch.traced(_bwd_loop) if launch.TRACING.on else _bwd_loop
            _bwd_loop_[(M,)](*args, d, eps, BD=lay.bd, ORD=int(ord), num_warps=lay.warps)
        LAUNCHES["embed_bwd"] += 1
    return dx
