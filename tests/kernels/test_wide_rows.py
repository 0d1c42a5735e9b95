"""The wide-row kernels (`fwd_loop`, `bwd_dots` + `bwd_cols`) at small scale.

Groups wider than MAX_TILE_FWD (32768 columns) take the forward one, wider than
MAX_TILE_BWD (4096) the backward ones; through the interpreter such rows are slow,
so here the tile limits and chunk sizes shrink until rows of a few dozen columns take
them, with ragged last chunks, several chunks per group, several row blocks per program
and several programs: every path of their indexing, against the fp64 reference.
"""
import pytest
import torch
from helpers import assert_close, run_case
from ref64 import add_norm64

import fuseblock

pytestmark = [pytest.mark.kernel, pytest.mark.kernel_only("the Triton kernels' layouts"),
              pytest.mark.usefixtures("small_wide_rows")]


F32, BF16 = torch.float32, torch.bfloat16


# Every kind with every residual mode (the kernels' constexprs); the bias (HAS_B) and the
# dtype (the casts) laid over them so that each pair of any two of the four options occurs
@pytest.mark.parametrize("kind,res,affine,dtype", [
    ("rms", "none", "w", F32), ("rms", "same", "w", F32), ("rms", "fp32", "wb", BF16),
    ("layer", "none", "w", F32), ("layer", "same", "w", BF16), ("layer", "fp32", "wb", F32),
    ("l2", "none", "wb", BF16), ("l2", "same", "wb", F32), ("l2", "fp32", "w", F32),
], ids=str)
def test_wide_row_kernels_match_fp64_reference(kind, dtype, res, affine, launches):
    d, rows = 37, 29  # 5 chunks of 8 (the last has 5 columns); 8 row blocks of 4 over 3 programs a chunk
    x = torch.randn(rows, d).to(dtype) * 3 + 2  # an offset mean: the centring matters
    residual = None if res == "none" else torch.randn(rows, d).to(dtype)
    w = torch.randn(d).to(dtype)
    b = torch.randn(d).to(dtype) if affine == "wb" else None
    rdtype = torch.float32 if res == "fp32" else None
    launches.reset()
    run_case(x, residual, w, b, kind=kind, residual_dtype=rdtype)
    assert launches("fwd", "bwd") == (1, 2)


# each gate position with each activation, each of those pairs' kind alternating
@pytest.mark.parametrize("position,act,kind", [("pre", "sigmoid", "rms"), ("pre", "silu", "layer"),
                                               ("post", "sigmoid", "layer"), ("post", "silu", "rms")])
def test_wide_row_kernels_gated(position, act, kind):
    d, rows = 21, 10
    run_case(torch.randn(rows, d), torch.randn(rows, d), torch.randn(d), torch.randn(d), kind=kind,
             gate=torch.randn(rows, d), gate_act=act, gate_position=position)


@pytest.mark.parametrize("groups,dg", [(3, 24), (4, 5)])
def test_wide_row_kernels_with_groups(groups, dg):
    # (3, 24): three chunks per group; (4, 5): one ragged chunk per group
    d = groups * dg
    run_case(torch.randn(9, d) + 1, torch.randn(9, d), torch.randn(d), torch.randn(d), kind="layer",
             num_groups=groups)


def test_wide_row_kernels_without_weight_or_residual_gradient():
    x = torch.randn(13, 40)
    run_case(x, None, None, None, kind="rms", grad_res=False)


def test_wide_row_layer_statistics_survive_a_large_offset():
    # Welford per lane, merged: a sum-of-squares variance, E[x^2] - mean^2, would lose
    # ~6% of it here in fp32 (ulp(1e6) = 0.06); what remains is the fp32 rounding of the
    # mean itself (ulp(1000) / 2 = 3e-5, times rstd = 1)
    x = 1000.0 + torch.randn(6, 50)
    out = fuseblock.norm(x, kind="layer", eps=0.0)
    ref = torch.nn.functional.layer_norm(x.double(), (50,), eps=0.0)
    torch.testing.assert_close(out.double(), ref, atol=2e-4, rtol=0)


def test_constant_wide_rows_give_zero_output_and_finite_gradients():
    x = torch.full((5, 40), 3.0, requires_grad=True)
    out = fuseblock.norm(x, kind="layer", eps=1e-5)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()



@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_wide_row_non_finite_values_stay_in_their_row(kind, bad):
    # the per-lane Welford statistics and the column-chunk backward, which walks down
    # the rows, must not carry a bad row's values into its neighbours
    x, w, b = torch.randn(9, 40), torch.randn(40), torch.randn(40)
    dirty = x.clone()
    dirty[4, 13] = bad

    def run(inp):
        inp = inp.clone().requires_grad_()
        out = fuseblock.norm(inp, w, b, kind=kind)
        return out.detach(), torch.autograd.grad(out, inp, torch.ones_like(out))[0]

    (clean_out, clean_dx), (out, dx) = run(x), run(dirty)
    others = [0, 1, 2, 3, 5, 6, 7, 8]
    assert torch.equal(out[others], clean_out[others]) and torch.equal(dx[others], clean_dx[others])
    assert not torch.isfinite(out[4]).all()


def test_wide_row_kernels_on_strided_rows_and_empty_batches():
    # rows of a wider buffer (row stride 50, not 37): the kernels index by stride
    base, res_base = torch.randn(11, 50), torch.randn(11, 50)
    run_case(base[:, 5:42], res_base[:, :37], torch.randn(37), torch.randn(37), kind="layer")
    x = torch.randn(0, 37, requires_grad=True)
    w = torch.randn(37, requires_grad=True)
    out = fuseblock.norm(x, w, kind="rms")
    dx, dw = torch.autograd.grad(out.sum(), (x, w))
    assert out.shape == (0, 37) and torch.equal(dw, torch.zeros(37))


@pytest.mark.parametrize("ord", ["l1", "l2", "max"])
def test_embed_norm_takes_its_loop_kernels_under_the_same_limits(ord, monkeypatch):
    # embed_norm reads the core op's tile limits at call time, so shrinking them here
    # sends rows of 37 columns to its own loop kernels too (it once bound them by value)
    import fuseblock.kernels.embed_norm as E

    ran = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            ran.append(self.kernel.fn.__name__)
            return self.kernel[grid]

    for name in ("_fwd_loop", "_bwd_loop"):
        monkeypatch.setattr(E, name, Spy(getattr(E, name)))
    x = torch.randn(9, 37, requires_grad=True)
    y = fuseblock.embed_norm(x, ord)
    p = {"l1": 1.0, "l2": 2.0, "max": float("inf")}[ord]
    xr = x.detach().double().requires_grad_()
    ref = torch.nn.functional.normalize(xr, p=p, dim=-1)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    cot = torch.randn(9, 37)
    dx, dx_ref = torch.autograd.grad(y, x, cot)[0], torch.autograd.grad(ref, xr, cot.double())[0]
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-4, atol=1e-5)
    assert ran == ["_fwd_loop", "_bwd_loop"]


class _Split:
    """Records `bwd_cols`'s launches (grid, row blocks, chunks) and works out, apart from the
    kernel, the stream-K split they make: program p takes items [p T // P, (p + 1) T // P)
    of the T = chunks x row blocks, chunk-major."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch(*args, **kw):
            named = dict(zip(self.kernel.arg_names, args, strict=False))
            n_cols = named["G"] * -(-named["DG"] // kw["BD"])
            self.launches.append((grid, n_cols, -(-named["M"] // kw["BR"])))
            return run(*args, **kw)

        return launch

    def chunks_and_sharers(self):
        """(chunks each program touches, programs sharing each chunk) of the last launch."""
        (n_p,), n_cols, n_b = self.launches[-1]
        t = n_cols * n_b
        touched = [range(p * t // n_p // n_b, ((p + 1) * t // n_p - 1) // n_b + 1) for p in range(n_p)]
        return [len(r) for r in touched], [sum(c in r for r in touched) for c in range(n_cols)]


@pytest.fixture
def split(monkeypatch):
    """`bwd_cols` watched, and `slots(n)` makes the wave n programs (num_sms as a GPU reads it too)."""
    import fuseblock.kernels.launch as L
    import fuseblock.kernels.norm as K

    spy = _Split(K.bwd_cols)
    monkeypatch.setattr(K, "bwd_cols", spy)
    monkeypatch.setattr(K, "COLS_PROGRAMS_PER_SM", 1)

    def slots(n):
        monkeypatch.setattr(L, "H100_SMS", n)
        monkeypatch.setattr(L, "num_sms", lambda device: n)

    spy.slots = slots
    return spy


# (rows, slots) -> the split's edge it reaches: rms rows of 37 are 5 chunks of 8 columns (the
# last 5), layer norm's 3 groups of 20 are 9 (8 + 8 + 4 a group); row blocks of 4 rows
STREAM_K = {
    "spans_3_chunks": (6, 2),  # 2 programs of 10 or 18 items: 3 and 5 chunks each, the middle one shared
    "many_per_chunk": (29, 29),  # a chunk of 8 row blocks (the last ragged) over 3 to 6 programs
    "one_item_each": (8, 64),  # as many programs as items (the wave is larger): every chunk shared
    "one_row_block": (3, 2),  # 5 or 9 chunks of one item over 2 programs: none shared, dw stored directly
}


@pytest.mark.parametrize("case", list(STREAM_K))
@pytest.mark.parametrize("kind", ["rms", "layer_groups"])
def test_stream_k_split_matches_fp64_reference(split, case, kind):
    # A wave that the chunks do not divide: the programs split the (chunk, row block) items
    # evenly, a chunk's rows among several programs and a program's across several chunks
    # (and groups); dx, dw, db against the fp64 reference whichever program summed what
    rows, slots = STREAM_K[case]
    split.slots(slots)
    groups, d = (3, 60) if kind == "layer_groups" else (1, 37)
    x, residual = torch.randn(rows, d) * 3 + 2, torch.randn(rows, d)
    run_case(x, residual, torch.randn(d), torch.randn(d) if groups > 1 else None,
             kind="layer" if groups > 1 else "rms", num_groups=groups)
    (n_p,), n_cols, n_b = split.launches[-1]
    chunks, sharers = split.chunks_and_sharers()
    assert n_cols == (9 if groups > 1 else 5) and n_cols % n_p != 0  # the even split's slots would idle
    if case == "spans_3_chunks":
        assert n_p == 2 and min(chunks) >= 3 and max(sharers) == 2
    elif case == "many_per_chunk":
        assert n_p == slots and max(sharers) >= 3
    elif case == "one_item_each":
        assert n_p == n_cols * n_b < slots and n_b == 2 and sharers == [2] * n_cols
    else:
        assert n_b == 1 and n_p == 2 and max(chunks) >= 3 and sharers == [1] * n_cols


def test_stream_k_dropout_masks_follow_the_elements(split):
    # dropout's masks are drawn by element position, not by program: dx, dx1 and dresidual
    # are the same bits under a split that shares chunks (3 programs, 25 items: 2 rows a
    # block with dropout) and one that gives each of the 5 chunks its own program; dw and db
    # differ only in the order of their fp32 sums, and both match the fp64 reference on the masks
    d, rows, p, alpha = 37, 9, 0.3, 0.75
    x, x1, residual, w, b = (torch.randn(rows, d), torch.randn(rows, d), torch.randn(rows, d), torch.randn(d),
                             torch.randn(d))
    g_out, g_res = torch.randn(rows, d), torch.randn(rows, d)

    def grads(slots):
        split.slots(slots)
        leaves = [t.detach().requires_grad_() for t in (x, x1, residual, w, b)]
        torch.manual_seed(5)
        out, new_res = fuseblock.add_norm(*leaves[:1], leaves[2], *leaves[3:], kind="layer", alpha=alpha,
                                          x1=leaves[1], dropout_p=p)
        return torch.autograd.grad((out * g_out).sum() + (new_res * g_res).sum(), leaves)

    shared = grads(3)
    assert split.launches[-1][0] == (3,) and split.chunks_and_sharers() == ([2, 3, 2], [1, 2, 1, 2, 1])
    own = grads(5)
    assert split.launches[-1][0] == (5,) and split.chunks_and_sharers() == ([1] * 5, [1] * 5)
    for a, b_ in zip(shared[:3], own[:3], strict=True):
        assert torch.equal(a, b_)
    torch.manual_seed(5)  # the masks, from a forward on x = 1, x1 = 0 (then x = 0, x1 = 1)
    kx = fuseblock.add_norm(torch.ones(rows, d), None, None, x1=torch.zeros(rows, d), dropout_p=p)[1] != 0
    torch.manual_seed(5)
    kx1 = fuseblock.add_norm(torch.zeros(rows, d), None, None, x1=torch.ones(rows, d), dropout_p=p)[1] != 0
    leaves = [t.double().requires_grad_() for t in (x, x1, residual, w, b)]
    ref_out, ref_p = add_norm64(leaves[0] * kx / (1 - p), leaves[2], leaves[3], leaves[4], kind="layer", alpha=alpha,
                                x1=leaves[1] * kx1 / (1 - p))
    ref = torch.autograd.grad((ref_out * g_out.double()).sum() + (ref_p * g_res.double()).sum(), leaves)
    for name, g_shared, g_own, r in zip(("x", "x1", "residual", "weight", "bias"), shared, own, ref, strict=True):
        assert_close(g_shared, r, torch.float32, f"d{name}")
        assert_close(g_own, r, torch.float32, f"d{name}")
