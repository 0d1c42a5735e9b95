"""What the launchers of every kernel module share: the launch record, the layout rule,
how activations and parameters are handed to a kernel, and the partial-row sums.

- `LAUNCHES`: kernel launches per kind, for tests and benchmarks that check "one launch
  per call";
- `layout`: the tile kernels' [BR rows, BG groups, BD columns] block for rows that fit
  in registers, else the wide-row kernels' column chunks (`fwd_layout`, `bwd_layout`);
- `rows`, `vec`, `stride`: the stride contract (activations by row stride with unit
  column stride, parameters unit-stride);
- `nan_max`: a max that keeps NaN, for the reductions that feed a scale or a reciprocal;
- `sum_partial_rows` (`_bwd_sum`): the parameters' gradients, in their own dtypes, from
  fp32 partial rows that programs wrote (the norm's tile backward, group norm's per-sample
  shares); `sum_rows` is also the last step of the norm's wide-row backward;
- `on_device`: the launcher entries' device guard (Triton launches on the current CUDA
  device and its current stream, not on the tensors' device);
- `row_programs`, `sum_cols`: how many partial rows a backward splits its rows into, and
  how the sum of them is laid out. By default both follow the GPU (its SM count and the
  programs per SM learned from the compiled kernel), so the weight gradients' bits may
  differ between GPU models, and between the first call of a variant and the later ones.
  Under `torch.use_deterministic_algorithms(True)` both are fixed by the shape alone
  (`DETERMINISTIC_PROGRAMS`, `DETERMINISTIC_SUM_COLS`): the same bits on every GPU.

The constants are read at call time: tests shrink them to reach the wide-row kernels on
small inputs (tests/conftest.py, `small_wide_rows`).
"""
# No `from __future__ import annotations`: Triton 3.1's interpreter reads the string
# "tl.constexpr" as no annotation and passes BR, BD, ... as arrays (tests/tools/test_floor.py).

import collections
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..triton_support import TRACING
from .occupancy import programs_per_sm

LAUNCHES: collections.Counter = collections.Counter()


class _Traced:
    """A kernel's launches as torch.compile records them (`traced`)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._by_options: dict[tuple, object] = {}

    def __getitem__(self, grid):
        def launch_traced(*args, **kwargs):
            # Every parameter given: the graph's kernel node is analysed for what it writes
            # (so inputs it only reads are not cloned) by compiling it with exactly these
            # arguments, and Triton's defaults (the fp8 ones of _fwd_tile) are not filled there.
            for param in self.kernel.params[len(args):]:
                if param.has_default and param.name not in kwargs:
                    kwargs[param.name] = param.default
            return self._wrapped(kwargs)[grid](*args, **kwargs)

        return launch_traced

    def _wrapped(self, kwargs: dict):
        """wrap_triton of the kernel; with maxnreg (`NO_SPILL`), which torch.compile takes
        only in a triton.Config, of a one-config autotuner holding it and num_warps (no
        tuning: the one config runs)."""
        if "maxnreg" not in kwargs:
            return torch.library.wrap_triton(self.kernel)
        options = {"maxnreg": kwargs.pop("maxnreg"), "num_warps": kwargs.pop("num_warps", 4)}
        key = tuple(sorted(options.items()))
        tuner = self._by_options.get(key)
        if tuner is None:
            tuner = self._by_options[key] = triton.autotune([triton.Config({}, **options)], key=[])(self.kernel)
        return torch.library.wrap_triton(tuner)


_TRACED: dict[object, _Traced] = {}


def traced(kernel) -> _Traced:
    """The kernel as torch.compile records it: each launch a Triton kernel node of the graph
    (`torch.library.wrap_triton`), which Inductor compiles and launches itself; a plain
    launch where torch runs the op's body on real tensors. Launch sites take it only
    while `TRACING.on` (set by the op's body, `fuseblock.ops.registry`):
    `(traced(k) if TRACING.on else k)[grid](...)`."""
    found = _TRACED.get(kernel)
    if found is None:
        found = _TRACED[kernel] = _Traced(kernel)
    return found


MAX_TILE_FWD = 32768  # widest row (elements) the forward tile kernel holds in registers
# ... except for the variants that hold more per element: dropout (its mask), the pre-gate
# (a second input inside the norm) and groups (per-group sums). At 32768 their tile spills
# (sm_90 bf16: 1808 bytes a thread for dropout, 40 to 64 for the others), and timed on an H200
# (bf16, 2048 rows of 32768, docs/performance.md) the loop kernel took 0.54x (dropout), 0.76x
# (8 groups) and 0.96x (pre-gate) the tile's time. The other variants spill less and their
# tile stays faster: the loop took 1.46x (plain RMS), 1.09x (layer), 1.06x (post-gate),
# 1.29x (fp32 residual), 3.7x (fp8_row) and 5.5x (mxfp8) the tile's time.
MAX_TILE_FWD_HEAVY = 16384
# The backward keeps more blocks live. Compiled for sm_90 (bf16) with the forward's layout (32
# elements a thread; 16K-element tiles and 16 warps from d = 4096) it spilled 24 bytes a thread
# at d = 1024 and 2048 (dropout) and 136 to 1368 from 4096 on; with 16 a thread in 8K-element
# tiles still 16 to 184 at 8192 (gates, dropout, groups), and 8 at 1024 (an fp32 residual).
# So: 4096-element tiles, 8 elements a thread (16 warps: 95 to 128 registers at d = 1024),
# and rows past 4096 take the column kernels (bwd_dots + bwd_cols).
MAX_TILE_BWD = 4096
BWD_WIDE_TILE = 4096  # elements per program of the backward's tile for rows of 4096
BWD_PER_THREAD = 8  # and per thread
# Threads a narrow-row backward program takes at most. At 512 (16 warps) the tile backward at
# d = 1024 to 4096 compiles to 78 to 100 registers a thread (sm_90, bf16): one program an SM,
# 16 warps of 64. At 256 (fewer rows a program), 70 to 80 registers and 3 programs, 24 warps,
# for rms at d = 1024 and 2048 and layer at 2048 (docs/performance.md, the narrow-row
# backward): not yet timed on a GPU, so 512 stays (tools/bwd_threads.py compiles both).
BWD_MAX_THREADS = 512
# norm_add's kernels hold two norms' blocks: its forward tile stops at rows of 16384, its
# backward's at 4096 (norm_add.bwd_tile_layout spilled 104 to 584 bytes a thread past it, sm_90)
MAX_TILE_PAIR_FWD = 16384
MAX_TILE_PAIR_BWD = 4096
# rows per tile at most: 64 rows of 64 (layer norm, groups) spilled 8 to 56 bytes a thread on
# sm_90 and sm_100 in the forward's 128 threads; 32 rows hold 48 registers and no stack
MAX_ROWS = 32
SM_THREADS = 2048  # threads an SM runs at once (H100, B200; an MI300X or MI355X CU: 32 wavefronts of 64)
LOOP_BLOCK = 4096  # column chunk of the row-looping kernels
H100_SMS = 132  # SM count assumed when there is no GPU (the interpreter; offline compiles set their target's)


def hip_warp(arch: str) -> int:
    """Threads per wavefront Triton runs on an AMD GPU of `arch` (gcnArchName, as
    "gfx942:sramecc+:xnack-"): 64 on CDNA and GCN (gfx9 and older: MI300X gfx942, MI355X
    gfx950), 32 on RDNA (gfx10, gfx11, gfx12: Triton takes the device's warpSize)."""
    return 32 if int(arch.split(":")[0][3:-2]) >= 10 else 64


def gpu_warp() -> int:
    """Threads per warp on this process's GPUs: 32 on NVIDIA; on AMD, by GPU 0's arch."""
    if not torch.version.hip:
        return 32
    if not torch.cuda.is_available():  # a ROCm build on a machine without its GPU: CDNA's
        return 64
    return hip_warp(torch.cuda.get_device_properties(0).gcnArchName)


# Threads per warp. Fixed per process, as the vendor of the torch build is, from GPU 0 (offline
# compiles for the other vendor set it: fuseblock.testing.targets.for_target).
WARP = gpu_warp()
# Compile options of the launches that would otherwise spill for occupancy's sake. Left to
# itself, ptxas caps a kernel's registers at the count that keeps one more program resident
# (48 a thread for 256 threads: 5 per SM; 64 for 512: 2) and spills what does not fit:
# compiled for sm_90 and sm_100, _channel_fwd kept 8 to 32 bytes a thread on the stack at
# 64 or 128 registers, and needed 72 to 96 without the cap. maxnreg (NVIDIA only: AMD's
# compiler takes no such option and spills none of these) lifts the cap to the hardware's
# 255; the launch then holds what the registers allow (`occupancy.learn`).
NO_SPILL = {} if torch.version.hip else {"maxnreg": 255}
SUM_TILE = 2048  # _bwd_sum: elements per [partial rows, columns] block it loads
SUM_MIN_COLS = 32  # and at least 32 columns per program: 128 bytes of each fp32 partial row
# Deterministic mode: the most programs (partial rows) a backward splits its rows among,
# whatever the GPU: about one wave of the default on a 132-SM H100 (4 to 8 per SM), each
# still of at least MIN_ROWS_PER_PROGRAM rows.
DETERMINISTIC_PROGRAMS = 1024
DETERMINISTIC_SUM_COLS = 64  # and the sum's columns per program (its reduction order)


def on_device(arg: int):
    """Decorator of a launcher entry (a function the ops call) that runs with the CUDA device of
    its positional argument `arg` (a tensor every call passes) current, so that Triton
    launches on that GPU and on its current stream. Triton launches on whichever device is
    current (triton/runtime/jit.py): tensors on cuda:1 with cuda:0 current would crash,
    or with peer access run on GPU 0's stream, unordered with GPU 1's work.

    The guard is the entry's own first statement, not a wrapper (a call of its own on every
    launch, which the host's budget counts), written as every entry writes it:

        if t.is_cuda and t.get_device() != torch._C._cuda_getDevice():  # launch.on_device
            return launch.on_its_device(entry, t, locals())

    so the common case, the tensor on the current device (or on the CPU), costs no device
    switch: two builtin calls on CUDA, an attribute read on the CPU; nothing is allocated, so
    a CUDA graph may capture it. This decorator checks that the entry calls `on_its_device`
    and records `entry.device_arg`, which argument is read (tests enumerate the entries)."""

    def mark(launcher):
        if "on_its_device" not in launcher.__code__.co_names:
            raise TypeError(f"{launcher.__qualname__}: a launcher entry starts with the device guard "
                            f"(fuseblock.kernels.launch.on_device)")
        launcher.device_arg = arg
        return launcher

    return mark


def on_its_device(launcher, t: torch.Tensor, arguments: dict):
    """launcher(**arguments) with t's CUDA device current: an entry's guard (`on_device`) calls
    it, with its own arguments (`locals()` before anything else), where t is on another GPU."""
    with torch.cuda.device(t.get_device()):
        return launcher(**arguments)


# Plain-integer helpers: triton.cdiv and triton.next_power_of_2 are constexpr functions
# whose Python-side calls cost microseconds each, on every launch.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def warps(threads: int) -> int:
    """num_warps for a program of `threads` threads: the layouts are chosen in threads (elements
    per thread decide the registers), the launch counts warps of WARP."""
    return max(1, threads // WARP)


def fit_per_sm(num_warps: int) -> int:
    """Persistent programs per SM before occupancy is learned: as many as its threads allow.
    The first compiled launch of a variant caps it at what its registers allow
    (`occupancy.learn`); a smaller default would leave an SM part idle for good (the loop
    kernels launched 2 per SM where 5 to 6 fit: a third of a wave)."""
    return max(1, SM_THREADS // (num_warps * WARP))


_CUDA_SMS: dict[torch.device, int] = {}  # a GPU's SM count, asked once (a backward reads it twice a call)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        n = _CUDA_SMS.get(device)
        if n is None:
            n = torch.cuda.get_device_properties(device).multi_processor_count
            if device.index is not None:  # "cuda" alone is whichever device is current
                _CUDA_SMS[device] = n
        return n
    return H100_SMS


def deterministic() -> bool:
    """Whether the weight gradients must not depend on the GPU: torch's own switch,
    `torch.use_deterministic_algorithms(True)`, read per call (a host-side flag)."""
    return torch.are_deterministic_algorithms_enabled()


def row_programs(device: torch.device, variant: tuple, per_sm: int) -> int:
    """The programs a persistent backward may split its rows among, each summing its rows'
    weight-gradient terms into one fp32 partial row: as many as the GPU holds at once (one
    wave), or DETERMINISTIC_PROGRAMS in deterministic mode, whatever the GPU. Which rows
    program i sums, and in what order, follows from n and the shape alone (row blocks i,
    i + n, ... in most; a contiguous range of (column chunk, row block) items in
    the norm's `bwd_cols`), so a fixed n fixes the bits."""
    if deterministic():
        return DETERMINISTIC_PROGRAMS
    return num_sms(device) * programs_per_sm(device, variant, per_sm)


def sum_cols(d: int, device: torch.device) -> int:
    """Columns per program of the partial rows' sum (`_bwd_sum`): enough programs to
    spread over the SMs, at least SUM_MIN_COLS; in deterministic mode a fixed
    DETERMINISTIC_SUM_COLS, since the block shape sets the order of the sum."""
    if deterministic():
        return min(pow2(d), DETERMINISTIC_SUM_COLS)
    return max(SUM_MIN_COLS, min(pow2(d), pow2(cdiv(d, num_sms(device)))))


class Layout(NamedTuple):
    """How a launcher lays out rows of d columns in groups: the tile kernels' [BR, BG, BD]
    block, or the wide-row kernels' BD-column chunks (tile False, BR = BG = 1)."""

    tile: bool
    bg: int
    bd: int
    br: int
    warps: int
    per_sm: int  # persistent programs per SM, before occupancy is learned

    def variant(self, kernel: str, tensors: tuple, flags: dict) -> tuple:
        """The key of one compiled kernel variant: its code (and registers) depend on the
        block shape, the tensors' dtypes and the constexpr flags."""
        dtypes = tuple([None if t is None else t.dtype for t in tensors])  # a list: no generator, on every launch
        return (kernel, dtypes, self.br, self.bg, self.bd, self.warps, *sorted(flags.items()))


def loop_layout(dg: int) -> Layout:
    """The row-looping kernels' layout for groups of dg columns: one group at a time, in
    chunks of LOOP_BLOCK."""
    w = warps(256)
    return Layout(False, 1, min(LOOP_BLOCK, pow2(dg)), 1, w, fit_per_sm(w))


# Layouts already worked out, by their arguments and the constants they read (which tests
# and offline compiles change): a launcher asks for one on every call. Bounded, as _SPECS.
_LAYOUTS: dict[tuple, Layout] = {}


def layout(d: int, groups: int, max_tile: int, wide_tile: int = 16384, per_thread: int = 32,
           max_threads: int = 512) -> Layout:
    """The layout for rows of d in `groups`, whole rows in registers up to max_tile elements;
    rows of 4096 and more in tiles of wide_tile elements, per_thread a thread (at most 512
    threads; max_threads: fewer rows a narrow tile, down to one). Narrow rows: 4096-element
    tiles, at most MAX_ROWS rows.

    Measured on an H100 in bf16 (docs/performance.md): narrow rows want small tiles; rows
    of 4K and more want 16K-element tiles in the forward. The persistent backward starts
    from as many programs per SM as the threads allow, then what fits (`fit_per_sm`).
    """
    key = (d, groups, max_tile, wide_tile, per_thread, max_threads, MAX_ROWS, LOOP_BLOCK, WARP, SM_THREADS)
    found = _LAYOUTS.get(key)
    if found is None:
        found = _layout(d, groups, max_tile, wide_tile, per_thread, max_threads)
        if len(_LAYOUTS) < 4096:
            _LAYOUTS[key] = found
    return found


def _layout(d: int, groups: int, max_tile: int, wide_tile: int, per_thread: int, max_threads: int) -> Layout:
    dg = d // groups
    bg, bd = pow2(groups), pow2(dg)
    if bg * bd <= max_tile:
        wide = bg * bd >= 4096
        br = max(1, min(MAX_ROWS, (wide_tile if wide else 4096) // (bg * bd), max_threads * per_thread // (bg * bd)))
        w = warps(min(512, max(128, br * bg * bd // per_thread)))
        return Layout(True, bg, bd, br, w, fit_per_sm(w))
    return loop_layout(dg)


def fwd_layout(d: int, groups: int = 1, heavy: bool = False) -> Layout:
    """The forward's layout (MAX_TILE_FWD, read at call time); heavy: a variant whose tile
    stops at MAX_TILE_FWD_HEAVY (dropout, pre-gate, groups: `fuseblock.kernels.norm`)."""
    return layout(d, groups, min(MAX_TILE_FWD, MAX_TILE_FWD_HEAVY) if heavy else MAX_TILE_FWD)


def bwd_layout(d: int, groups: int = 1) -> Layout:
    """The backward's layout (MAX_TILE_BWD, read at call time)."""
    return layout(d, groups, MAX_TILE_BWD, BWD_WIDE_TILE, BWD_PER_THREAD, BWD_MAX_THREADS)


def rows(t: torch.Tensor | None, d: int) -> torch.Tensor | None:
    """(M, d) view with unit column stride; copies only inputs that cannot be viewed."""
    if t is None:
        return None
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def row_arg(t: torch.Tensor | None, d: int) -> tuple[torch.Tensor | None, int]:
    """(t, its row stride) as a kernel takes rows of d columns: a contiguous t as it is (the
    kernel reads only its address and the stride given; an (M, d) view of it would cost
    the host a few us a tensor), else `rows(t, d)` and its stride; (None, 0) for none."""
    if t is None:
        return None, 0
    if t.is_contiguous():
        return t, d
    t2 = rows(t, d)
    return t2, t2.stride(0)


def out_arg(t: torch.Tensor, M: int, d: int) -> tuple[torch.Tensor, int]:
    """(t, its row stride) for a kernel to write t's M rows of d: a contiguous t as it is,
    else (a caller's `out`, `fuseblock.serve`) through an (M, d) view, never a copy."""
    if t.is_contiguous():
        return t, d
    t2 = t.view(M, d)
    return t2, t2.stride(0)


def vec(t: torch.Tensor | None) -> torch.Tensor | None:
    """A (d,) weight or bias with unit stride, as the kernels index it (W + column): a
    sliced view, a matrix column or an expanded stride-0 vector is copied, never assumed."""
    return t if t is None or t.stride(0) == 1 else t.contiguous()


def stride(t: torch.Tensor | None) -> int:
    """The row stride of an optional tensor (0 when absent: the kernel never reads it)."""
    return t.stride(0) if t is not None else 0


@triton.jit
def nan_max(b, axis: tl.constexpr):
    """max of b along axis, NaN where any element is NaN, as torch's amax (tl.max drops NaN
    on a GPU, and in triton 3.9's interpreter): the sum of the NaN elements is NaN."""
    return tl.max(b, axis) + tl.sum(tl.where(b != b, b, 0.0), axis)


@triton.jit
def sum_rows(PART, OUT, n_rows, s_part, o_col, m_col, BR: tl.constexpr, BD: tl.constexpr):
    """OUT[o_col] = the sum of rows 0 .. n_rows - 1 of PART[:, o_col] (fp32), stored in
    OUT's dtype: one rounding, as the parameter's gradient. BR rows at a time, added up
    across them once at the end. The loads bypass L1 (.cg): the rows were written by
    other programs, on other SMs (see the norm's bwd_cols for when they are visible)."""
    o_r = tl.arange(0, BR)
    b_acc = tl.zeros([BR, BD], dtype=tl.float32)
    for i_r in range(0, n_rows, BR):
        o_row = (i_r + o_r).to(tl.int64)
        mask = (o_row < n_rows)[:, None] & m_col[None, :]
        b_acc += tl.load(PART + o_row[:, None] * s_part + o_col[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(OUT + o_col, tl.sum(b_acc, 0).to(OUT.dtype.element_ty), mask=m_col)


@triton.jit(do_not_specialize=["n_rows"])
def _bwd_sum(DWP, DBP, DW, DB, n_rows, D, BR: tl.constexpr, BD: tl.constexpr,
             HAS_W: tl.constexpr, HAS_B: tl.constexpr, DAP=None, DCP=None, DA=None, DC=None):
    # A backward's second launch: dw and db, both in one, from the (n_rows, D) partial
    # rows its first wrote (and two more, DA and DC where given: the norm's [d] scales);
    # program i_c sums columns i_c * BD ...
    o_col = tl.program_id(0) * BD + tl.arange(0, BD)
    m_col = o_col < D
    if HAS_W:
        sum_rows(DWP, DW, n_rows, D, o_col, m_col, BR, BD)
    if HAS_B:
        sum_rows(DBP, DB, n_rows, D, o_col, m_col, BR, BD)
    if DA is not None:
        sum_rows(DAP, DA, n_rows, D, o_col, m_col, BR, BD)
    if DC is not None:
        sum_rows(DCP, DC, n_rows, D, o_col, m_col, BR, BD)


def sum_partial_rows(dw_part, db_part, dw, db, n_rows: int, d: int, bd: int | None = None, scales=()) -> None:
    """Launch `_bwd_sum`: dw and db (either may be None), in their own dtypes, become the
    column sums of the (n_rows, d) fp32 partial rows dw_part and db_part. bd: `sum_cols`'s
    columns per program, where the caller has it. scales: (da_part, dc_part, da, dc), two
    more such gradients summed in the same launch (either may be None)."""
    if bd is None:
        bd = sum_cols(d, next(t for t in (dw_part, db_part, *scales) if t is not None).device)
    _bwd_sum_ = traced(_bwd_sum) if TRACING.on else _bwd_sum
    more = dict(zip(("DAP", "DCP", "DA", "DC"), scales, strict=True)) if scales else {}
    _bwd_sum_[(cdiv(d, bd),)](dw_part, db_part, dw, db, n_rows, d, BR=max(1, SUM_TILE // bd), BD=bd,
                             HAS_W=dw is not None, HAS_B=db is not None, num_warps=4, **more)
