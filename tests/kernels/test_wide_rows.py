"""The wide-row kernels (`_fwd_loop`, `_bwd_dots` + `_bwd_cols`) at small scale.

Groups wider than MAX_TILE_FWD (32768 columns) take the forward one, wider than
MAX_TILE_BWD (4096) the backward ones; through the interpreter such rows are slow,
so here the tile limits and chunk sizes shrink until rows of a few dozen columns take
them, with ragged last chunks, several chunks per group, several row blocks per program
and several programs: every path of their indexing, against the fp64 reference.
"""
import pytest
import torch
from helpers import run_case

import fuseblock

pytestmark = [pytest.mark.kernel, pytest.mark.kernel_only("the Triton kernels' layouts"),
              pytest.mark.usefixtures("small_wide_rows")]


@pytest.mark.parametrize("kind", ["rms", "layer", "l2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("res", ["none", "same", "fp32"])
@pytest.mark.parametrize("affine", ["w", "wb"])
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


@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("act", ["sigmoid", "silu"])
@pytest.mark.parametrize("kind", ["rms", "layer"])
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
