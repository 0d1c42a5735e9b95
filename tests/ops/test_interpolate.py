"""nGPT's interpolating update on the unit sphere (transformers' Dory): norm_add and
norm_add_norm with update="interpolate",

    r' = r + b * (N_b(x) - r),   out = N(r'),   N(t) = t * rsqrt(t.t + eps)

b a float or a [d] tensor (branch_scale). Against an fp64 reference written here from the
formula: the values and every gradient (b's included) on both paths; the torch path in fp32
bitwise DoryDecoderLayer's own ops; what the form does not take refused by name."""
import pytest
import torch

import fuseblock

D = 16
EPS = 1e-6


def _unit64(t, eps=EPS):
    t = t.double()
    return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + eps)


def _inputs(rows):
    x, r = torch.randn(rows, D), torch.randn(rows, D)
    x[0] *= 1e-3  # x.x near eps: eps on the sum of squares, not on their mean (d * eps), shows
    return x.requires_grad_(), r.requires_grad_()


def _call(op, x, r, b, eps=EPS):
    kw = dict(kind="l2", eps=eps, branch_scale=b, update="interpolate")
    if op == "norm_add":
        return [fuseblock.norm_add(x, r, **kw)]
    out, new_r = fuseblock.norm_add_norm(x, r, None, None, **kw)
    return [out, new_r]


@pytest.mark.kernel
@pytest.mark.parametrize("op,rows,form", [("norm_add_norm", 5, "tensor"), ("norm_add_norm", 70, "float"),
                                          ("norm_add", 70, "tensor")])
def test_interpolate_matches_fp64(op, rows, form):
    # 70 rows: two backward programs on the kernel path, whose partial rows of b's sums are added up
    x, r = _inputs(rows)
    b = torch.rand(D).requires_grad_() if form == "tensor" else 0.3
    got = _call(op, x, r, b)
    b64 = b.double() if form == "tensor" else b
    p64 = r.double() + b64 * (_unit64(x) - r.double())
    want = [p64] if op == "norm_add" else [_unit64(p64), p64]
    leaves = [x, r, b] if form == "tensor" else [x, r]
    grads_out = [torch.randn(o.shape, dtype=torch.float64) for o in want]
    g_got = torch.autograd.grad([o.double() for o in got], leaves, grads_out)
    g_want = torch.autograd.grad(want, leaves, grads_out)
    worst = max((o.double() - e).abs().max().item() for o, e in zip(got, want, strict=True))
    for g, w in zip(g_got, g_want, strict=True):
        assert g.dtype == torch.float32
        worst = max(worst, (g.double() - w).abs().max().item() / (1 + w.abs().max().item()))
    assert worst < 2e-6, worst


@pytest.mark.torch_only("the torch path's order of operations")
def test_interpolate_is_dorys_update_bitwise_in_fp32():
    """DoryL2Norm and DoryDecoderLayer's interpolation, written as its source writes them:
    the op's values and every gradient equal them bit for bit."""
    x, r = _inputs(6)
    lam = torch.randn(D, requires_grad=True)

    def l2(t):
        return t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + EPS)

    rate = (lam * 4.0).abs()
    h = r + rate * (l2(x) - r)
    want = [l2(h), h]
    got = _call("norm_add_norm", x, r, (lam * 4.0).abs())
    gout = [torch.randn_like(t) for t in want]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(torch.autograd.grad(got, (x, r, lam), gout), torch.autograd.grad(want, (x, r, lam), gout),
                    strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw,error,match", [
    (dict(update="lerp"), ValueError, r"update must be one of \('add', 'interpolate'\), got 'lerp'"),
    (dict(kind="rms"), ValueError, r"update='interpolate' normalizes onto the unit sphere .* it takes kind='l2', "
                                   r"got kind='rms'"),
    (dict(weight=True), ValueError, r"update='interpolate''s norms take no weight or bias .*: weight must be None"),
    (dict(residual_scale=0.5), ValueError, r"update='interpolate' takes no residual_scale"),
    (dict(quant="fp8_row"), ValueError, r"quant= does not take update='interpolate' yet"),
    (dict(out_dtype=torch.float64), ValueError, r"out_dtype does not take update='interpolate' yet"),
])
def test_interpolate_refuses_what_it_does_not_take(kw, error, match):
    x, r = torch.randn(3, D), torch.randn(3, D)
    kw = {**dict(kind="l2", branch_scale=torch.rand(D), update="interpolate"), **kw}
    weight = torch.ones(D) if kw.pop("weight", None) else None
    with pytest.raises(error, match=match):
        fuseblock.norm_add_norm(x, r, None, weight, **kw)
    if "quant" not in kw and "out_dtype" not in kw:  # (norm_add has neither)
        with pytest.raises(error, match=match):
            fuseblock.norm_add(x, r, weight, **kw)


def _check64(got, x, r, b, second=True, tol=2e-6):
    """got (out, new_residual) or (new_residual,) and every gradient against fp64."""
    p64 = r.double() + b.double() * (_unit64(x) - r.double())
    want = [_unit64(p64), p64] if second else [p64]
    cots = [torch.randn(o.shape, dtype=torch.float64) for o in want]
    g_got = torch.autograd.grad([o.double() for o in got], (x, r, b), cots)
    g_want = torch.autograd.grad(want, (x, r, b), cots)
    worst = max((o.double() - e).abs().max().item() for o, e in zip(got, want, strict=True))
    for g, w in zip(g_got, g_want, strict=True):
        worst = max(worst, (g.double() - w).abs().max().item() / (1 + w.abs().max().item()))
    assert worst < tol, worst


@pytest.mark.kernel
@pytest.mark.kernel_only("the wide-row kernels' layouts")
@pytest.mark.usefixtures("small_wide_rows")
def test_interpolate_wide_rows_through_the_loop_kernels(monkeypatch):
    # 5 rows of 19 (small_wide_rows): _fwd_loop and _bwd_loop (whose sweep 3 forms dp again,
    # dresidual holding (1 - b) * dp), norm_add_norm's and norm_add's
    import fuseblock.kernels.norm_add as NA

    monkeypatch.setattr(NA, "LOOP_TILE", 32)
    monkeypatch.setattr(NA, "MIN_ROWS_PER_PROGRAM", 4)
    x, r = (torch.randn(5, 19, requires_grad=True) for _ in range(2))
    b = torch.rand(19, requires_grad=True)
    kw = dict(kind="l2", eps=EPS, branch_scale=b, update="interpolate")
    _check64(fuseblock.norm_add_norm(x, r, None, None, **kw), x, r, b)
    _check64([fuseblock.norm_add(x, r, **kw)], x, r, b, second=False)


@pytest.mark.kernel
def test_interpolate_create_graph_gradients_equal_the_first_order_ones():
    # create_graph=True takes the differentiable form of the backward (the kernel path's graph_grads)
    x, r = torch.randn(4, D, requires_grad=True), torch.randn(4, D, requires_grad=True)
    b = torch.rand(D, requires_grad=True)
    outs = fuseblock.norm_add_norm(x, r, None, None, kind="l2", eps=EPS, branch_scale=b, update="interpolate")
    cots = [torch.randn(o.shape) for o in outs]
    first = torch.autograd.grad(outs, (x, r, b), cots, retain_graph=True)
    for g, h in zip(first, torch.autograd.grad(outs, (x, r, b), cots, create_graph=True), strict=True):
        torch.testing.assert_close(g, h)


@pytest.mark.kernel
@pytest.mark.kernel_only("the Triton kernels' launch counts")
def test_interpolate_adds_no_launch(launches):
    # the interpolation is a flag of the same kernels: the launches of the plain update with a [d] scale
    x, r = torch.randn(70, D, requires_grad=True), torch.randn(70, D, requires_grad=True)
    b = torch.rand(D, requires_grad=True)
    counts = []
    for kw in (dict(branch_scale=b), dict(branch_scale=b, update="interpolate")):
        launches.reset()
        out, p = fuseblock.norm_add_norm(x, r, None, None, kind="l2", eps=EPS, **kw)
        (out.sum() + p.sum()).backward()
        counts.append(launches("fwd", "bwd"))
    assert counts[0] == counts[1] and counts[0][0] == 1


@pytest.mark.kernel
def test_interpolate_takes_alpha_as_its_float_rate():
    # alpha is branch_scale's float form: norm_add's plain-call fast lane (no branch_scale) must not take it
    x, r = _inputs(5)
    b = torch.full((D,), 0.3)
    for op in ("norm_add", "norm_add_norm"):
        kw = dict(kind="l2", eps=EPS, alpha=0.3, update="interpolate")
        got = [fuseblock.norm_add(x, r, **kw)] if op == "norm_add" else list(
            fuseblock.norm_add_norm(x, r, None, None, **kw))
        for g, e in zip(got, _call(op, x, r, b), strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-6)


@pytest.mark.torch_only("compiled through the interpreter it takes minutes")
def test_interpolate_under_torch_compile_fullgraph(recwarn):
    # the interpolation and its unit-sphere norms as plain torch ops, one graph (its spec made anew
    # while traced: no lru_cache read, of which Dynamo warns)
    def fn(x, r, b):
        out, p = fuseblock.norm_add_norm(x, r, None, None, kind="l2", eps=EPS, branch_scale=b, update="interpolate")
        return out * 2 + p

    inputs = [torch.randn(*s, requires_grad=True) for s in ((4, D), (4, D), (D,))]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(*inputs), fn(*inputs)
    torch.testing.assert_close(got, want)
    for g, e in zip(torch.autograd.grad(got.square().sum(), inputs), torch.autograd.grad(want.square().sum(), inputs),
                    strict=True):
        torch.testing.assert_close(g, e)
    assert not [w for w in recwarn if "lru_cache" in str(w.message)]
