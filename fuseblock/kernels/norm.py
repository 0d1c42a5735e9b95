"""Triton kernels for the fused residual-add + normalize (+ gate) op, forward and backward.

Two layouts, picked per call by the width of one normalized group:
- `tile`: a [BR rows, BG groups, BD columns] block holds whole rows in registers, many
  rows per program. Used when a row fits (BG * BD <= MAX_TILE_FWD / MAX_TILE_BWD).
- wide rows, which do not fit in registers (forward: a group wider than MAX_TILE_FWD;
  backward: wider than MAX_TILE_BWD): the forward loops over column chunks of one row at
  a time (`fwd_loop`); the backward takes two launches, the per-row constants
  (`bwd_dots`) then a column-chunk pass (`bwd_cols`): `fuseblock.kernels.norm_wide`'s
  kernels, launched from here. The row math both layouts share is `fuseblock.kernels.row_math`'s.

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
stores in the parameters' dtypes; `bwd_cols` sums them itself, in the last program of
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
    vec,
    warps,
)
from .norm_wide import bwd_cols, bwd_dots, fwd_loop
from .occupancy import learn, programs_per_sm
from .row_math import (
    GATE_POST,
    GATE_PRE,
    SCALE_VEC,
    bwd_block,
    check_modes,
    gate_act,
    load_p,
    row_mean,
    row_rstd,
    row_weight,
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

    b_p = load_p(X, X1, R, RO, SEED, RS, BS, row * s_x + col, row * s_x1 + col, row * s_r + col, row * s_ro + col,
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


# --------------------------------------------------------------------------- backward
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
        b_sw, b_sb, b_srs, b_sbs = bwd_block(
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
            variant = lay.variant("fwd_loop", (x2, x12, r2, z2, weight, bias, o2, ro2), flags)
            n_prog = min(M * G, num_sms(dev) * programs_per_sm(dev, variant, lay.per_sm))
            _fwd_loop_ = launch.traced(fwd_loop) if launch.TRACING.on else fwd_loop
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
    rows `bwd_dots` + `bwd_cols`, which sums its own partial rows.
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
    variant = lay.variant("_bwd_tile" if lay.tile else "bwd_cols", (p2, z2, weight, bias, do2, dro2, dx, dr, dz),
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
    # for each program and chunk it touches: n_prog + n_cols - 1 pairs at most (bwd_cols).
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
        cnt = torch.empty((n_cols,), dtype=torch.int32, device=dev) if sum_parts else None  # zeroed by bwd_dots
        dots_lay = loop_layout(dg)
        dots_flags = dict(BD=dots_lay.bd, HAS_W=need_dw, CENTER=spec.center, GATE=int(spec.gate),
                          ACT=int(spec.act), ZERO_CNT=sum_parts)
        dots_variant = dots_lay.variant("bwd_dots", (p2, z2, weight, do2), dots_flags)
        n_dots = min(M * G, num_sms(dev) * programs_per_sm(dev, dots_variant, dots_lay.per_sm))
        _bwd_dots_ = launch.traced(bwd_dots) if launch.TRACING.on else bwd_dots
        dots_compiled = _bwd_dots_[(n_dots,)](p2, z2, weight, rstd, mean, do2, dots, cnt, s_p, s_z,
                                             s_do, M * G, G, dg, spec.scale, spec.weight_offset, n_cols,
                                             num_warps=dots_lay.warps, **dots_flags)
        learn(dev, dots_variant, dots_compiled, dots_lay.warps)
        _bwd_cols_ = launch.traced(bwd_cols) if launch.TRACING.on else bwd_cols
        compiled = _bwd_cols_[(n_prog,)](p2, z2, weight, bias, rstd, mean, dots, *outs, dw, db, drs, dbs, cnt,
                                        *strides,
                                        M, G, dg, spec.scale, spec.weight_offset, *_branch(spec),
                                        BR=lay.br, BD=lay.bd, SUM_PARTS=sum_parts, num_warps=lay.warps, **flags,
                                        **(launch.NO_SPILL if spec.dropout_p > 0 else {}))
        LAUNCHES["bwd"] += 2
    learn(dev, variant, compiled, lay.warps)
    return (*grads, dw, db, dx1, drs, dbs)
