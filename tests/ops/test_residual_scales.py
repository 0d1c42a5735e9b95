"""Per-channel residual updates (nGPT, Muse Spark): residual_scale a and branch_scale b,
each a float or a [d] tensor, on add_norm (r' = a * r + b * (x + x1)), norm_add
(r' = a * r + b * N_b(x)) and norm_add_norm (and out = N(r')).

Against fp64 references written here from the formula (not fuseblock's own reference):
the values and every gradient, the scales' included, on both paths (the kernel path
under the interpreter, tiny shapes; one wide-row case through the loop kernels)."""
import pytest
import torch

import fuseblock
from fuseblock.ops.norm import norm_op
from fuseblock.ops.norm_add import norm_add_op
from fuseblock.spec import Act, Gate, NormSpec

EPS = torch.finfo(torch.float32).eps
D = 16


def _rms64(t, w, b=None, center=False, eps=EPS):
    t = t.double()
    if center:
        t = t - t.mean(-1, keepdim=True)
    out = t * torch.rsqrt(t.square().mean(-1, keepdim=True) + eps) * w.double()
    return out if b is None else out + b.double()


def _scale(form, d, offset=0.0):
    """A scale of the given form: 'tensor' (a [d] leaf in fp32), 'float', or None (not given)."""
    if form == "tensor":
        return (torch.randn(d) + offset).requires_grad_()
    return {"float": 0.75, None: None}[form]


def _d64(s):
    return s.double() if isinstance(s, torch.Tensor) else (1.0 if s is None else s)


def _check(outputs, expected, leaves, tol=2e-5):
    """Values and the gradients of every leaf against the fp64 expectation, one seeded
    gradient at each output."""
    grads_out = [torch.randn(o.shape, dtype=torch.float64) for o in outputs]
    got = torch.autograd.grad([o.double() for o in outputs], leaves, grads_out)
    want = torch.autograd.grad(expected, leaves, grads_out)
    worst = 0.0
    for o, e in zip(outputs, expected, strict=True):
        worst = max(worst, (o.double() - e).abs().max().item())
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32  # the scales' gradients in their own dtype, as the weight's
        worst = max(worst, (g.double() - w).abs().max().item() / (1 + w.abs().max().item()))
    assert worst < tol, worst
    return worst


@pytest.mark.kernel
@pytest.mark.parametrize("rows,rs,bs,x1", [(5, "tensor", "tensor", False), (70, "float", "tensor", True),
                                           (5, "tensor", "float", False)])
def test_add_norm_scales_match_fp64(rows, rs, bs, x1):
    # 70 rows: two backward programs, whose partial rows of the scales' sums are added up
    x, r = torch.randn(rows, D, requires_grad=True), torch.randn(rows, D, requires_grad=True)
    x1 = torch.randn(rows, D, requires_grad=True) if x1 else None
    w = torch.randn(D, requires_grad=True)
    a, b = _scale(rs, D), _scale(bs, D)
    out, p = fuseblock.add_norm(x, r, w, residual_scale=a, branch_scale=b, x1=x1)
    u = x.double() if x1 is None else x.double() + x1.double()
    p64 = _d64(a) * r.double() + _d64(b) * u
    leaves = [t for t in (x, r, x1, w, a, b) if isinstance(t, torch.Tensor)]
    _check([out, p], [_rms64(p64, w), p64], leaves)


@pytest.mark.kernel
@pytest.mark.parametrize("second,kind,rs,bs", [(False, "rms", "tensor", "tensor"), (True, "layer", "tensor", "float"),
                                               (True, "rms", "float", "tensor")])
def test_norm_add_scales_match_fp64(second, kind, rs, bs):
    rows = 6
    x, r = torch.randn(rows, D, requires_grad=True), torch.randn(rows, D, requires_grad=True)
    bw, w = torch.randn(D, requires_grad=True), torch.randn(D, requires_grad=True)
    bb = torch.randn(D, requires_grad=True) if kind == "layer" else None  # N_b(x) with its bias, in d b
    a, b = _scale(rs, D), _scale(bs, D)
    center, eps = kind == "layer", 1e-5 if kind == "layer" else EPS
    p64 = _d64(a) * r.double() + _d64(b) * _rms64(x, bw, bb, center, eps)
    if second:
        out, p = fuseblock.norm_add_norm(x, r, bw, w, bb, kind=kind, residual_scale=a, branch_scale=b)
        outputs, expected = [out, p], [_rms64(p64, w, None, center, eps), p64]
    else:
        outputs, expected = [fuseblock.norm_add(x, r, bw, bb, kind=kind, residual_scale=a, branch_scale=b)], [p64]
    leaves = [t for t in (x, r, bw, bb, w if second else None, a, b) if isinstance(t, torch.Tensor)]
    _check(outputs, expected, leaves)


@pytest.mark.kernel
@pytest.mark.kernel_only("the wide-row kernels' layouts")
@pytest.mark.usefixtures("small_wide_rows")
def test_wide_rows_take_the_scales_through_the_loop_kernels(monkeypatch):
    # 5 rows of 19 (small_wide_rows): add_norm's fwd_loop and bwd_cols (3 column chunks,
    # the last ragged, partial rows shared by programs), norm_add_norm's _fwd_loop and
    # _bwd_loop (whose sweep 3 forms dp again)
    import fuseblock.kernels.norm_add as NA

    monkeypatch.setattr(NA, "LOOP_TILE", 32)
    monkeypatch.setattr(NA, "MIN_ROWS_PER_PROGRAM", 4)
    rows, d = 5, 19
    x, r, x1 = (torch.randn(rows, d, requires_grad=True) for _ in range(3))
    w, bw = torch.randn(d, requires_grad=True), torch.randn(d, requires_grad=True)
    a, b = _scale("tensor", d), _scale("tensor", d)
    out, p = fuseblock.add_norm(x, r, w, residual_scale=a, branch_scale=b, x1=x1)
    p64 = a.double() * r.double() + b.double() * (x.double() + x1.double())
    _check([out, p], [_rms64(p64, w), p64], [x, r, x1, w, a, b])
    out, p = fuseblock.norm_add_norm(x, r, bw, w, residual_scale=a, branch_scale=b)
    p64 = a.double() * r.double() + b.double() * _rms64(x, bw)
    _check([out, p], [_rms64(p64, w), p64], [x, r, bw, w, a, b])


@pytest.mark.kernel
def test_dropout_masks_reach_the_branch_scales_gradient():
    # r' = a * r + b * drop(x): what drop(x) was is read off r' itself, (r' - a * r) / b
    # in fp64, and the gradients checked against it: d b = sum dp * drop(x), d a = sum dp * r,
    # dx = b * dp where kept (scaled by 1/(1 - p)), else 0
    x, r = torch.randn(9, D, requires_grad=True), torch.randn(9, D, requires_grad=True)
    a, b = _scale("tensor", D), _scale("tensor", D, offset=4.0)  # b away from 0: the division is exact enough
    _, p = fuseblock.add_norm(x, r, None, residual_scale=a, branch_scale=b, dropout_p=0.5)
    dp = torch.randn(p.shape)
    dx, dr, da, db = torch.autograd.grad(p, (x, r, a, b), dp)
    kept = (p.double() - a.double() * r.double()) / b.double()
    assert 0.2 < (kept.abs() > 1e-4).double().mean() < 0.8  # about half dropped
    torch.testing.assert_close(dr, dp * a)
    torch.testing.assert_close(da, (dp * r).sum(0))
    torch.testing.assert_close(db.double(), (dp.double() * kept).sum(0), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dx.double(), torch.where(kept.abs() > 1e-4, dp.double() * b.double() * 2, 0.0),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.kernel
def test_float_scales_are_alpha_and_the_plain_op():
    # a float branch_scale is alpha (one meaning, bit for bit); residual_scale=1 is the plain call
    x, r, w = torch.randn(4, D), torch.randn(4, D), torch.randn(D)
    for got, want in ((fuseblock.add_norm(x, r, w, branch_scale=1.5), fuseblock.add_norm(x, r, w, alpha=1.5)),
                      (fuseblock.add_norm(x, r, w, residual_scale=1.0, branch_scale=1.0), fuseblock.add_norm(x, r, w)),
                      ((fuseblock.norm_add(x, r, w, branch_scale=0.5),), (fuseblock.norm_add(x, r, w, alpha=0.5),))):
        for g, e in zip(got, want, strict=True):
            assert torch.equal(g, e)


@pytest.mark.kernel
@pytest.mark.kernel_only("the Triton kernels' launch counts")
def test_the_scales_add_no_launch(launches):
    x, r = torch.randn(70, D, requires_grad=True), torch.randn(70, D, requires_grad=True)
    w, bw = torch.randn(D, requires_grad=True), torch.randn(D, requires_grad=True)
    a, b = _scale("tensor", D), _scale("tensor", D)
    counts = []
    for scales in ({}, dict(residual_scale=a, branch_scale=b)):
        launches.reset()
        out, p = fuseblock.add_norm(x, r, w, **scales)
        (out.sum() + p.sum()).backward()
        out, p = fuseblock.norm_add_norm(x, r, bw, w, **scales)
        (out.sum() + p.sum()).backward()
        counts.append(launches("fwd", "bwd"))
    assert counts[0] == counts[1] and counts[0][0] == 2  # each op: one forward, and the same backward launches


def _op_call(op, **scales):
    x, r, w = torch.randn(3, D), torch.randn(3, D), torch.randn(D)
    if op == "add_norm":
        return fuseblock.add_norm(x, r, w, **scales)
    if op == "norm_add":
        return fuseblock.norm_add(x, r, w, **scales)
    return fuseblock.norm_add_norm(x, r, w, w, **scales)


@pytest.mark.parametrize("op", ["add_norm", "norm_add", "norm_add_norm"])
@pytest.mark.parametrize("scales,error,names", [
    (dict(residual_scale=torch.ones(D - 1)), ValueError, "residual_scale must have shape"),
    (dict(branch_scale=torch.ones(2, D)), ValueError, "branch_scale must have shape"),
    (dict(branch_scale=torch.ones(D, dtype=torch.float16)), TypeError, "branch_scale must be float32"),
    (dict(residual_scale=torch.ones(D, dtype=torch.int32)), TypeError, "residual_scale must be a floating"),
    (dict(residual_scale="1"), TypeError, "residual_scale must be a real number"),
    (dict(branch_scale=float("nan")), ValueError, "branch_scale must be finite"),
    (dict(alpha=2.0, branch_scale=torch.ones(D)), ValueError, "alpha and branch_scale"),
    (dict(alpha=2.0, branch_scale=3.0), ValueError, "alpha and branch_scale"),
])
def test_bad_scales_are_refused_by_name(op, scales, error, names):
    with pytest.raises(error, match=names):
        _op_call(op, **scales)


def test_residual_scale_needs_a_residual_and_no_quant():
    x, w = torch.randn(3, D), torch.randn(D)
    with pytest.raises(ValueError, match="residual_scale scales the residual"):
        fuseblock.add_norm(x, None, w, residual_scale=torch.ones(D))
    with pytest.raises(ValueError, match="quant= does not take residual_scale"):
        fuseblock.add_norm(x, x, w, residual_scale=0.5, quant="fp8_row")


@pytest.mark.torch_only("compiled through the interpreter it takes minutes: the kernel path's registration "
                        "is opcheck'ed below")
def test_scales_under_torch_compile_fullgraph():
    # the [d] scales as plain torch ops, one graph
    def fn(x, r, w, a, b):
        out, p = fuseblock.add_norm(x, r, w, residual_scale=a, branch_scale=b)
        return out * 2 + p

    inputs = [torch.randn(*s, requires_grad=True) for s in ((4, D), (4, D), (D,), (D,), (D,))]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(*inputs), fn(*inputs)
    torch.testing.assert_close(got, want)
    for g, e in zip(torch.autograd.grad(got.square().sum(), inputs), torch.autograd.grad(want.square().sum(), inputs),
                    strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.kernel
@pytest.mark.kernel_only("the custom op serves the Triton path")
def test_the_ops_schemas_and_fakes_take_the_scales():
    # what torch.compile traces on the kernel path: the registered ops with the [d] scales
    x, r = torch.randn(3, D, requires_grad=True), torch.randn(3, D, requires_grad=True)
    w, a, b = (torch.randn(D, requires_grad=True) for _ in range(3))
    spec = NormSpec(False, 1.0, 1e-6, Gate.NONE, Act.UNUSED, 1).with_branch(1.0, 0.0, 0.5).pack()
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(norm_op.fwd_op, (x, r, None, w, None, spec, torch.float32, True, None, None, a, b),
                          test_utils=checks)
    torch.library.opcheck(norm_add_op.fwd_op, (x, r, w, None, w, None, [*spec, *spec, 1.0], torch.float32, True, True,
                                               a, b), test_utils=checks)


@pytest.mark.kernel
def test_create_graph_gradients_equal_the_first_order_ones():
    # create_graph=True takes the differentiable form of the backward (the kernel path's
    # graph_grads): the same gradients, the scales' included
    x, r = torch.randn(4, D, requires_grad=True), torch.randn(4, D, requires_grad=True)
    w, bw, a, b = (torch.randn(D, requires_grad=True) for _ in range(4))
    for call, leaves in ((lambda: fuseblock.add_norm(x, r, w, residual_scale=a, branch_scale=b, x1=r),
                          (x, r, w, a, b)),
                         (lambda: fuseblock.norm_add_norm(x, r, bw, w, residual_scale=a, branch_scale=b),
                          (x, r, bw, w, a, b))):
        outs = call()
        cots = [torch.randn(o.shape) for o in outs]
        first = torch.autograd.grad(outs, leaves, cots, retain_graph=True)
        for g, h in zip(first, torch.autograd.grad(outs, leaves, cots, create_graph=True), strict=True):
            torch.testing.assert_close(g, h)
