"""Property-based tests: random shapes, sizes, dtypes and options against the fp64 reference,
plus the row-isolation guarantees (non-finite values and all-zero rows)."""
import pytest
import torch
from helpers import run_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuseblock

PRIMES = [2, 3, 5, 7, 31, 97, 257, 1009]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def cases(draw):
    d = draw(st.one_of(st.sampled_from([1] + PRIMES), st.integers(1, 700), st.sampled_from([65537, 70001])))
    wide = d > 65536
    lead_sizes = st.integers(1, 1) if wide else st.integers(0, 3)
    lead = draw(st.lists(lead_sizes, min_size=0, max_size=1 if wide else 2))
    dtype = draw(st.sampled_from(FLOATS))
    opts = dict(
        kind=draw(st.sampled_from(["rms", "layer", "l2"])),
        eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])),
    )
    if draw(st.booleans()):
        opts["c"] = draw(st.floats(0.25, 4.0))
    if draw(st.booleans()):
        opts["gate_position"] = draw(st.sampled_from(["pre", "post"]))
        opts["gate_act"] = draw(st.sampled_from(["none", "sigmoid", "silu", "swish"]))
    groups = draw(st.sampled_from([g for g in (1, 2, 3, 4) if d % g == 0 and not wide]) if not wide else st.just(1))
    opts["num_groups"] = groups
    flags = draw(st.booleans()), draw(st.booleans())  # drawn in this order: the examples stay the same
    return d, tuple(lead), dtype, opts, *flags, draw(st.sampled_from(["none", "same", "fp32"]))


@pytest.mark.kernel
@SETTINGS
@given(cases())
def test_random_cases_match_fp64_reference(case):
    d, lead, dtype, opts, has_w, has_b, res = case
    shape = lead + (d,)
    x = torch.randn(shape).to(dtype)
    residual = None if res == "none" else torch.randn(shape).to(dtype)
    w = torch.randn(d).to(dtype) if has_w else None
    b = torch.randn(d).to(dtype) if has_b else None
    if "gate_position" in opts:
        opts = dict(opts, gate=torch.randn(shape).to(dtype))
    run_case(x, residual, w, b, residual_dtype=torch.float32 if res == "fp32" else None, **opts)


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer", "l2"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("d", [48, 20000])
def test_non_finite_values_stay_in_their_row(kind, bad, d):
    x = torch.randn(6, d)
    w, b = torch.randn(d), torch.randn(d)
    dirty = x.clone()
    dirty[2, 5] = bad

    def run(inp):
        inp = inp.clone().requires_grad_()
        wl = w.clone().requires_grad_()
        out = fuseblock.norm(inp, wl, b, kind=kind)
        g = torch.ones_like(out)
        dx, dw = torch.autograd.grad(out, (inp, wl), g)
        return out.detach(), dx, dw

    clean_out, clean_dx, _ = run(x)
    out, dx, dw = run(dirty)
    others = [0, 1, 3, 4, 5]
    assert torch.equal(out[others], clean_out[others])
    assert torch.equal(dx[others], clean_dx[others])
    # dw sums over rows: the bad row may poison columns (all of them for NaN, whose rstd is
    # NaN; one for inf, whose other entries normalize to 0), but every finite entry equals
    # the other rows' sum alone.
    _, _, dw_others = run(x[others])
    finite = torch.isfinite(dw)
    assert not finite.all()
    torch.testing.assert_close(dw[finite], dw_others[finite], atol=1e-4, rtol=1e-5)


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer", "l2"])
@pytest.mark.parametrize("d", [1, 37, 20000])
def test_all_zero_row_gives_exactly_the_bias(kind, d):
    x = torch.randn(3, d, requires_grad=True)
    with torch.no_grad():
        x[1] = 0
    w, b = torch.randn(d, requires_grad=True), torch.randn(d)
    out = fuseblock.norm(x, w, b, kind=kind, eps=1e-5)
    assert torch.equal(out[1], b)
    dx, dw = torch.autograd.grad(out.sum(), (x, w))
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()


@pytest.mark.kernel
@pytest.mark.parametrize("d", [64, 40000])
def test_rows_past_2_to_the_31_elements_are_addressed_with_64_bit_offsets(d):
    # Row 1 starts 2**31 + 64 elements (over 4 GiB) after row 0. 32-bit offsets would wrap
    # and read the wrong memory. The storage is allocated but only two rows are touched.
    # The interpreter's numpy pointers are 64-bit anyway: this guards the compiled kernels.
    if not torch.cuda.is_available() or torch.empty(0).device.type != "cuda":
        pytest.skip("int32 offset overflow is a property of compiled GPU kernels")
    stride = 2**31 + 64
    storage = torch.empty(stride + d, dtype=torch.bfloat16)
    x = storage.as_strided((2, d), (stride, 1))
    x.copy_(torch.randn(2, d).bfloat16())
    w = torch.randn(d)
    results = []
    for inp in (x.clone(), x):  # the same values, contiguous and 4 GiB apart
        inp = inp.detach().requires_grad_()
        out = fuseblock.norm(inp, w, kind="layer")
        (dx,) = torch.autograd.grad(out.float().square().sum(), inp)
        results.append((out, dx))
    (ref_out, ref_dx), (out, dx) = results
    assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx)
    del storage


@pytest.mark.kernel
@pytest.mark.parametrize("value", [3.3, 7.77, -1234.567])
@pytest.mark.parametrize("d,groups", [(8, 1), (1000, 1), (20000, 1), (24, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_constant_rows_of_a_layer_norm_give_exactly_the_bias(value, d, groups, dtype):
    # a remainder in the fp32 mean would be multiplied by rstd = 1/sqrt(eps) = 1000
    x = torch.full((4, d), value).to(dtype)
    w, b = torch.randn(d).to(dtype), torch.randn(d).to(dtype)
    for res in (None, torch.zeros_like(x)):
        out, _ = fuseblock.add_norm(x, res, w, b, kind="layer", eps=1e-6, num_groups=groups)
        assert torch.equal(out, b.expand_as(out)), (out - b).abs().max()


@pytest.mark.kernel
@pytest.mark.parametrize("value", [3.3, 7.77])
def test_constant_rows_through_the_wide_row_kernels(small_wide_rows, value):
    x = torch.full((9, 37), value, requires_grad=True)
    b = torch.randn(37)
    out = fuseblock.norm(x, torch.randn(37), b, kind="layer", eps=1e-6)
    assert torch.equal(out, b.expand_as(out))
    assert torch.isfinite(torch.autograd.grad(out.sum(), x)[0]).all()


@pytest.mark.kernel
@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1.0, 1e20, 1e30])
@pytest.mark.parametrize("kind", ["l2", "rms", "layer"])
@pytest.mark.parametrize("d", [16, 20000])
def test_eps_zero_normalizes_rows_of_any_scale(scale, kind, d):
    # eps = 0: the statistics sum squares in fp64, so 1e-30^2 does not underflow to 0
    # (out = inf) and 1e30^2 does not overflow (out = 0): l2 rows have unit length, rms
    # and layer rows unit root-mean-square, and the gradients stay finite
    x = (torch.randn(3, d) * scale).requires_grad_()
    out = fuseblock.norm(x, kind=kind, eps=0.0)
    size = out.double().norm(dim=-1) / (1.0 if kind == "l2" else d ** 0.5)
    torch.testing.assert_close(size, torch.ones(3, dtype=torch.float64), rtol=1e-5, atol=0)
    x64 = x.detach().double()
    ref = x64 / x64.norm(dim=-1, keepdim=True) * (1.0 if kind == "l2" else d ** 0.5)
    if kind != "layer":
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(torch.autograd.grad(out[:, :3].sum(), x)[0]).all()


@pytest.mark.kernel
@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_eps_zero_through_the_wide_row_kernels(small_wide_rows, scale):
    x = torch.randn(9, 37) * scale
    for kind in ("l2", "layer"):
        out = fuseblock.norm(x, kind=kind, eps=0.0)
        size = out.double().norm(dim=-1) / (1.0 if kind == "l2" else 37 ** 0.5)
        torch.testing.assert_close(size, torch.ones(9, dtype=torch.float64), rtol=1e-5, atol=0)
