"""norm_add (post-norm) and norm_add_norm (sandwich): values and every gradient against an
fp64 reference composed from ref64.add_norm64, both paths; strides, wide rows, double
backward, torch.compile, launch counts, and named errors for bad input."""
import os

import pytest
import torch
from helpers import KERNEL_PATH, assert_close, interpreted_only
from ref64 import add_norm64, leaf64

import fuseblock

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KINDS = ["rms", "layer", "l2"]


def _eps(kind, dtype, eps):
    """torch's default eps for a norm reading `dtype` (what eps=None means), else eps."""
    if eps is not None:
        return eps
    return 1e-5 if kind == "layer" else torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _norm64(p, weight, bias, kind, eps, woff):
    """N(p) in fp64 by add_norm64 (no residual), weight_offset folded into the weight."""
    w = None if weight is None else weight.double() + woff
    return add_norm64(p, None, w, bias, kind=kind, eps=eps)[0]


def reference64(x, residual, branch_weight, branch_bias, weight=None, bias=None, *, kind="rms", eps=None,
                branch_eps=None, weight_offset=0.0, branch_weight_offset=None, alpha=1.0, residual_dtype=None,
                second=True):
    """(out or None, new_residual) in fp64, written from the definitions:
    new_residual = residual + alpha * N_b(x), rounded to its stored dtype (the rounding passes
    gradients straight through, as add_norm64's); out = N(new_residual)."""
    rdtype = residual_dtype or torch.promote_types(x.dtype, residual.dtype)
    b_eps = _eps(kind, x.dtype, eps if branch_eps is None else branch_eps)
    b_woff = weight_offset if branch_weight_offset is None else branch_weight_offset
    p = residual.double() + alpha * _norm64(x.double(), branch_weight, branch_bias, kind, b_eps, b_woff)
    p = p + (p.to(rdtype).double() - p).detach()
    if not second:
        return None, p
    return _norm64(p, weight, bias, kind, _eps(kind, rdtype, eps), weight_offset), p


def _params(d, dtype, bias=True):
    w = (1 + 0.1 * torch.randn(d)).to(dtype)
    b = (0.1 * torch.randn(d)).to(dtype) if bias else None
    return w, b


def _check(op, x, residual, bw, bb, w=None, b=None, *, residual_dtype=None, graded=(0, 1), **kw):
    """Run `op` forward and backward (random gradients at the outputs `graded` indexes:
    norm_add_norm's out 0 and new_residual 1) and compare the outputs and every leaf's
    gradient with reference64's."""
    second = op == "norm_add_norm"
    if not second:  # norm_add has the branch norm only
        w = b = None
    named = {k: t for k, t in dict(x=x, residual=residual, branch_weight=bw, branch_bias=bb, weight=w,
                                   bias=b).items() if t is not None}
    leaves = [t.requires_grad_(True) for t in named.values()]
    if second:
        out, new_res = fuseblock.norm_add_norm(x, residual, bw, w, bb, b, residual_dtype=residual_dtype, **kw)
        outs = [out, new_res]
    else:
        new_res = fuseblock.norm_add(x, residual, bw, bb, residual_dtype=residual_dtype, **kw)
        out, outs = None, [new_res]
    rdtype = residual_dtype or torch.promote_types(x.dtype, residual.dtype)
    assert new_res.dtype == rdtype and new_res.shape == x.shape
    l64 = {k: leaf64(t) for k, t in named.items()}
    ref_out, ref_p = reference64(l64["x"], l64["residual"], l64.get("branch_weight"), l64.get("branch_bias"),
                                 l64.get("weight"), l64.get("bias"), residual_dtype=rdtype, second=second, **kw)
    assert_close(new_res, ref_p, rdtype, "new_residual")
    ref_outs = [ref_p]
    if second:
        assert out.dtype == x.dtype and out.shape == x.shape
        assert_close(out, ref_out, x.dtype, "out")
        ref_outs = [ref_out, ref_p]
    if second:
        outs, ref_outs = [outs[i] for i in graded], [ref_outs[i] for i in graded]
    gouts = [torch.randn_like(t) for t in outs]
    grads = torch.autograd.grad(outs, leaves, gouts, allow_unused=True)
    ref_grads = torch.autograd.grad(ref_outs, list(l64.values()), [g.double() for g in gouts], allow_unused=True)
    # d = 1: a layer norm's intermediates of 1/sqrt(eps) cancel only in exact arithmetic
    # (helpers.run_case allows the same 16x there); an RMS norm's dx is rstd * g * w * (1 - xhat^2),
    # its 1 - xhat^2 fp32 noise times rstd (a GPU's fused multiply-adds left 1.7x atol at rstd ~ 100)
    cond = 16.0 if x.shape[-1] == 1 else 1.0
    for (name, leaf), g, rg in zip(named.items(), grads, ref_grads, strict=True):
        if rg is None:  # out's parameters, when only new_residual is graded: none either way, or zeros
            assert g is None or not g.any(), name
            continue
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, name
        assert_close(g, rg, leaf.dtype, f"d{name}", cond=cond, per_row=g.dim() > 1)


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", ["norm_add", "norm_add_norm"])
def test_values_and_every_gradient_match_fp64(op, kind, dtype):
    # 130 rows: several backward programs, so the partial-row sums run too
    x, residual = torch.randn(130, 48).to(dtype), torch.randn(130, 48).to(dtype)
    bw, bb = _params(48, dtype)
    w, b = _params(48, dtype)
    _check(op, x, residual, bw, bb, w, b, kind=kind, alpha=0.7)


@pytest.mark.kernel
@pytest.mark.parametrize("d", [1, 7, 300])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_row_widths(kind, d):
    x, residual = torch.randn(2, 5, d), torch.randn(2, 5, d)
    bw, bb = _params(d, torch.float32)
    w, b = _params(d, torch.float32)
    # a layer norm of d = 1 is the bias alone, its x gradient zero: the fp64 check holds there too
    _check("norm_add_norm", x, residual, bw, bb, w, b, kind=kind, alpha=0.3)


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "l2"])
def test_eps_zero_normalizes_rows_of_any_scale(kind):
    """eps=0: the sums of squares in fp64 (as add_norm's), so rows of 1e-30 and 1e30 still
    normalize; the fp64 reference agrees."""
    x = torch.randn(4, 24) * torch.tensor([1e-30, 1e-3, 1.0, 1e30])[:, None]
    residual = torch.randn(4, 24)
    bw, _ = _params(24, torch.float32)
    w, _ = _params(24, torch.float32)
    _check("norm_add_norm", x, residual, bw, None, w, None, kind=kind, eps=0.0, graded=(0,))


@pytest.mark.kernel
@pytest.mark.parametrize("graded", [(0,), (1,)], ids=["out", "new_residual"])
def test_a_gradient_at_one_output_only(graded):
    x, residual = torch.randn(70, 32), torch.randn(70, 32)
    bw, bb = _params(32, torch.float32)
    w, b = _params(32, torch.float32)
    _check("norm_add_norm", x, residual, bw, bb, w, b, kind="layer", alpha=1.5, graded=graded)


@pytest.mark.kernel
@pytest.mark.parametrize("op", ["norm_add", "norm_add_norm"])
def test_fp32_residual_stream_under_bf16_activations(op):
    x, residual = torch.randn(3, 5, 40).bfloat16(), torch.randn(3, 5, 40)
    bw, bb = _params(40, torch.bfloat16)
    w, b = _params(40, torch.float32)
    _check(op, x, residual, bw, bb, w, b, kind="layer", alpha=1.3)  # promoted: fp32 new_residual
    _check(op, x, residual.bfloat16(), bw, None, w, None, residual_dtype=torch.float32, kind="rms")


@pytest.mark.kernel
def test_branch_options_are_the_branch_norms_own():
    """branch_eps and branch_weight_offset apply to N_b only; eps and weight_offset to N
    (and to N_b too where the branch ones are None)."""
    x, residual = torch.randn(20, 24), torch.randn(20, 24)
    bw, bb = _params(24, torch.float32)
    w, b = _params(24, torch.float32)
    x = x * 1e-2  # small rows: eps matters
    _check("norm_add_norm", x, residual, bw - 1, bb, w - 1, b, kind="rms", eps=1e-3, branch_eps=1e-4,
           weight_offset=1.0, branch_weight_offset=0.5, alpha=-0.5)
    _check("norm_add_norm", x, residual, bw - 1, None, w - 1, None, kind="layer", eps=1e-3, weight_offset=1.0)
    _check("norm_add", x, residual, bw - 1, bb, kind="rms", eps=1e-3, weight_offset=1.0, alpha=2.0)


@pytest.mark.kernel
@pytest.mark.parametrize("op", ["norm_add", "norm_add_norm"])
def test_without_weights_where_the_kind_allows(op):
    x, residual = torch.randn(9, 32), torch.randn(9, 32)
    if op == "norm_add":
        _check(op, x, residual, None, None, kind="rms")
        _check(op, x, residual, None, torch.randn(32) * 0.1, kind="layer")
    else:
        _check(op, x, residual, None, None, None, None, kind="l2")


@pytest.mark.kernel
@pytest.mark.parametrize("op", ["norm_add", "norm_add_norm"])
def test_strided_inputs(op):
    """x a column slice, residual a transposed copy's transpose, parameters strided views."""
    big = torch.randn(17, 80)
    x = big[:, 8:40]
    residual = torch.randn(32, 17).t()
    bw = (1 + 0.1 * torch.randn(64))[::2]
    w = (1 + 0.1 * torch.randn(32, 2))[:, 0]
    assert not x.is_contiguous() and not residual.is_contiguous() and bw.stride(0) == 2
    _check(op, x, residual, bw, None, w, None, kind="layer", alpha=0.5)


@pytest.fixture
def wide_loops(small_wide_rows, monkeypatch):
    """small_wide_rows, and _bwd_loop's blocks shrunk with it: 2 rows by 8 columns (43
    columns: 6 chunks, the last ragged), at least 2 rows per program (12 rows: 6 blocks
    over 4 programs, so two of them update their partial rows a second time)."""
    import fuseblock.kernels.norm_add as K

    for name, value in dict(LOOP_ROWS=2, LOOP_TILE=16, MIN_ROWS_PER_PROGRAM=2).items():
        monkeypatch.setattr(K, name, value)


@pytest.mark.kernel
@pytest.mark.parametrize("op", ["norm_add", "norm_add_norm"])
def test_wide_rows(op, wide_loops):
    """Rows wider than the tile (shrunk by the fixture): the loop kernels, one launch
    forward, `_bwd_loop` and the partial rows' sum backward; still right."""
    x, residual = torch.randn(12, 43), torch.randn(12, 43)  # ragged chunks
    bw, bb = _params(43, torch.float32)
    w, b = _params(43, torch.float32)
    _check(op, x, residual, bw, bb, w, b, kind="rms", alpha=0.9)
    _check(op, x.bfloat16(), residual, bw.bfloat16(), bb.bfloat16(), w, b, kind="layer", alpha=0.9)
    _check(op, *(t.bfloat16() for t in (x, residual, bw, bb, w, b)), kind="layer", alpha=-1.5)
    _check(op, x * 1e-20, residual, bw, None, w, None, kind="l2", eps=0.0)
    if op == "norm_add_norm":  # a gradient at one output only
        _check(op, x, residual, bw, bb, w, b, kind="layer", alpha=0.9, graded=(0,))
        _check(op, x, residual, bw, bb, w, b, kind="layer", alpha=0.9, graded=(1,))
    _check(op, x[:1], residual[:1], bw, bb, w, b, kind="layer", alpha=0.9)  # one row: one program, one block
    strided = torch.randn(12, 50)[:, 4:47]  # rows 50 apart: the kernels index by row stride
    _check(op, strided, residual.t().contiguous().t(), bw, None, w, None, kind="rms", alpha=0.5)


@pytest.mark.kernel
def test_wide_rows_compile_and_return_no_alias(small_wide_rows):
    """norm_add's wide-row backward, traced whole: its dresidual (the incoming gradient,
    for norm_add) is a fresh tensor, as a custom op's output must be (it was the input
    itself: torch.library's aliasing check refused it)."""
    x, residual, w = torch.randn(6, 43, requires_grad=True), torch.randn(6, 43, requires_grad=True), torch.ones(43)

    def fn(x, residual):
        return fuseblock.norm_add(x, residual, w, alpha=0.5)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = []
    for f in (fn, compiled):
        new_res = f(x, residual)
        got.append(torch.autograd.grad(new_res, (x, residual), torch.ones_like(new_res)))
        torch.testing.assert_close(got[-1][1], torch.ones_like(residual))
    torch.testing.assert_close(got[0][0], got[1][0])


@pytest.mark.parametrize("kind", KINDS)
def test_gradgradcheck_torch_path(kind):
    """fp64 takes the torch path (on the kernel run too: test_torch_path.py holds that), so
    its second derivatives are autograd's; run once, on the torch path."""
    x, residual = torch.randn(3, 6, dtype=torch.float64, requires_grad=True), torch.randn(3, 6, dtype=torch.float64,
                                                                                      requires_grad=True)
    bw, bb, w, b = (torch.randn(6, dtype=torch.float64, requires_grad=True) for _ in range(4))

    def sandwich(*a):
        return fuseblock.norm_add_norm(*a, kind=kind, alpha=0.8)

    def post(x, residual, bw, bb):
        return fuseblock.norm_add(x, residual, bw, bb, kind=kind, alpha=0.8)

    assert torch.autograd.gradgradcheck(sandwich, (x, residual, bw, w, bb, b))
    assert torch.autograd.gradgradcheck(post, (x, residual, bw, bb))


@pytest.mark.kernel
def test_double_backward_on_fp32_matches_fp64():
    """create_graph=True on fp32 (the kernel path's differentiable rebuild there): the
    gradient of a gradient against the fp64 reference's."""
    x, residual = torch.randn(4, 16), torch.randn(4, 16)
    bw, bb = _params(16, torch.float32)
    w, b = _params(16, torch.float32)
    ts = [t.requires_grad_(True) for t in (x, residual, bw, bb, w, b)]
    t64 = [leaf64(t) for t in ts]
    gout, gres = torch.randn(4, 16), torch.randn(4, 16)

    def second(fn, args, cast):
        out, new_res = fn(*args)
        g = torch.autograd.grad((out, new_res), args, (cast(gout), cast(gres)), create_graph=True)
        gg = torch.autograd.grad(sum((gi * gi).sum() for gi in g), args, allow_unused=True)
        return [torch.zeros_like(a) if t is None else t for a, t in zip(args, gg, strict=True)]  # out's bias: unused

    got = second(lambda *a: fuseblock.norm_add_norm(a[0], a[1], a[2], a[4], a[3], a[5], kind="layer", alpha=0.6),
                 ts, lambda t: t)
    ref = second(lambda *a: reference64(*a, kind="layer", alpha=0.6, residual_dtype=torch.float64), t64,
                 lambda t: t.double())
    for name, g, rg in zip(("x", "residual", "branch_weight", "branch_bias", "weight", "bias"), got, ref, strict=True):
        torch.testing.assert_close(g.double(), rg, atol=2e-4, rtol=2e-4, msg=name)


def _sandwich(x, r, bw, w, bb, b):
    out, res = fuseblock.norm_add_norm(x, r, bw, w, bb, b, kind="layer", alpha=0.5)
    return out * 2 + fuseblock.norm_add(out, res, bw, kind="rms")


@pytest.mark.kernel
def test_torch_compile_fullgraph_no_break(monkeypatch):
    import fuseblock.triton_support as ts

    # as in a fresh process: the kernel modules are imported on first use, which must be
    # inside the custom op, never in traced code (the import is a graph break)
    monkeypatch.setattr(ts, "_loaded", {})
    torch._dynamo.reset()
    inputs = [torch.randn(*s, requires_grad=True) for s in ((3, 5, 16), (3, 5, 16), (16,), (16,), (16,), (16,))]
    explained = torch._dynamo.explain(_sandwich)(*inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    graph = str(explained.graphs[0].graph)
    assert ("fuseblock.norm_add_norm_fwd" in graph) == KERNEL_PATH
    compiled = torch.compile(_sandwich, fullgraph=True, backend="aot_eager")

    def run(fn):
        out = fn(*inputs)
        return [out, *torch.autograd.grad(out.square().sum(), inputs)]

    for a, b in zip(run(compiled), run(_sandwich), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.kernel
@pytest.mark.kernel_only("counts Triton launches")
@pytest.mark.parametrize("layout", ["tile", "wide"])
@pytest.mark.parametrize("op", ["norm_add", "norm_add_norm"])
def test_one_launch_forward_at_most_two_backward(op, layout, request):
    from helpers import AllLaunches

    # tile: 130 rows, 3 programs; wide: 12 rows of 43, 4 programs (the wide_loops fixture)
    rows, d = (130, 48) if layout == "tile" else (12, 43)
    if layout == "wide":
        request.getfixturevalue("wide_loops")
    x, residual = torch.randn(rows, d, requires_grad=True), torch.randn(rows, d, requires_grad=True)
    bw, bb = (t.requires_grad_() for t in _params(d, torch.float32))
    w, b = (t.requires_grad_() for t in _params(d, torch.float32))
    with AllLaunches() as fwd:
        outs = ([fuseblock.norm_add(x, residual, bw, bb, alpha=0.5)] if op == "norm_add"
                else list(fuseblock.norm_add_norm(x, residual, bw, w, bb, b, alpha=0.5)))
    grads = [torch.randn_like(t) for t in outs]
    leaves = [x, residual, bw, bb] + ([w, b] if op == "norm_add_norm" else [])
    with AllLaunches() as bwd:
        torch.autograd.grad(outs, leaves, grads)
    assert (fwd.kernels, fwd.ops) == (1, [])
    assert bwd.kernels == 2 and bwd.ops == [], bwd.ops  # the tile or loop pass, then the four partial-row sums
    if fwd.names is not None:
        assert fwd.names == ["_fwd_tile" if layout == "tile" else "_fwd_loop"]
        assert bwd.names == ["_bwd_tile" if layout == "tile" else "_bwd_loop", "_bwd_sum4"]


@pytest.mark.kernel
@pytest.mark.kernel_only("what the kernels' backward keeps")
@pytest.mark.parametrize("op", ["norm_add", "norm_add_norm"])
def test_saved_for_backward_only_x_the_stored_sum_and_row_statistics(op):
    x, residual = torch.randn(10, 32, requires_grad=True), torch.randn(10, 32, requires_grad=True)
    bw, bb = (t.requires_grad_() for t in _params(32, torch.float32))
    w, b = (t.requires_grad_() for t in _params(32, torch.float32))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        if op == "norm_add":
            new_res = fuseblock.norm_add(x, residual, bw, bb, kind="layer")
        else:
            _, new_res = fuseblock.norm_add_norm(x, residual, bw, w, bb, b, kind="layer")
    rows = [t for t in saved if t.shape == x.shape]
    assert len(rows) == (1 if op == "norm_add" else 2)  # x, and new_residual for the second norm
    assert rows[0] is x and (op == "norm_add" or rows[1] is new_res)
    stats = [t for t in saved if t.shape == (10,)]
    assert len(stats) == (2 if op == "norm_add" else 4) and all(t.dtype == torch.float32 for t in stats)


@pytest.mark.torch_only("the torch path's plain ops")
def test_no_custom_op_on_the_torch_path():
    x = torch.randn(3, 16, requires_grad=True)
    for out in (fuseblock.norm_add(x, x, kind="l2"), fuseblock.norm_add_norm(x, x, x[0], x[1])[0]):
        name = type(out.grad_fn).__name__
        assert "fuseblock" not in name and "Eager" not in name, name


@pytest.mark.kernel
@pytest.mark.kernel_only("counts the interpreter's loads and stores")
@interpreted_only
@pytest.mark.parametrize("layout", ["tile", "wide"])
@pytest.mark.parametrize("op", ["norm_add", "norm_add_norm"])
def test_fused_op_moves_the_compulsory_bytes(op, layout, request):
    """Activation bytes the minimum, forward and backward, on tile and on wide rows (where
    the loop kernels re-read rows within a launch: tests/kernels/test_traffic.py counts
    those); the unfused form moves more, even with each torch norm charged as one kernel
    (as on CUDA) (fuseblock.testing.op_traffic.measure_residual_traffic)."""
    from fuseblock.testing.op_traffic import measure_residual_traffic

    if layout == "wide":  # 24 rows of 64, past the shrunk tile: 12 blocks of 2 rows, 8 chunks each
        request.getfixturevalue("wide_loops")
    rows, d = (256, 128) if layout == "tile" else (24, 64)
    rows = {r["pas"]: r for r in measure_residual_traffic(op, rows, d, torch.bfloat16)}
    for pas in ("fwd", "bwd"):
        assert rows[pas]["act_over_min"] == 1.0, rows[pas]
        assert rows[pas]["glue_ops"] == 0
    assert rows["fwd"]["launches"] == 1 and rows["bwd"]["launches"] == 2
    # measured 1.70 and 1.97 (tile, 256 x 128)
    assert rows["fwd+bwd"]["naive1_over_kernel"] > (1.5 if layout == "tile" else 1.2), rows["fwd+bwd"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs triton's compiler")
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_kernels_compile_for_h100_without_spills(kind):
    """Triton's compiler (no GPU needed) builds every launch for sm_90; the backward's
    layout (bwd_tile_layout) keeps its blocks in registers up to rows of 4096, and the
    loop kernels (rows of 20000) have nothing to spill."""
    pytest.importorskip("triton")
    import fuseblock.kernels.launch as L
    import fuseblock.kernels.norm_add as K
    from fuseblock.ops.dispatch import kernels_on_cpu
    from fuseblock.spec import NormSpec
    from fuseblock.testing.targets import captured_launches, compile_for, resource_usage

    launches = []
    for d in (1000, 4096):
        spec = NormSpec.of(d, kind=kind, c=None, eps=1e-6, num_groups=1, gate_act=None, gate_position=None)
        x, w = torch.empty(512, d, dtype=torch.bfloat16), torch.empty(d, dtype=torch.bfloat16)
        b = w if kind == "layer" else None
        stat = torch.empty(512)
        mean = stat if kind == "layer" else None
        with kernels_on_cpu(), captured_launches(K, L) as got:
            K.norm_add_fwd(x, x, w, b, w, b, spec, spec, 0.5, torch.bfloat16, True, True)
            K.norm_add_bwd(x, x, x, x, w, b, w, b, stat, mean, stat, mean, spec, spec, 0.5, torch.bfloat16, True)
        assert [ln.name for ln in got] == ["_fwd_tile", "_bwd_tile", "_bwd_sum4"]
        launches += got
    d = 20000  # the forward's loop kernel
    spec = NormSpec.of(d, kind=kind, c=None, eps=1e-6, num_groups=1, gate_act=None, gate_position=None)
    x, w = torch.empty(512, d, dtype=torch.bfloat16), torch.empty(d, dtype=torch.bfloat16)
    b = w if kind == "layer" else None
    stat = torch.empty(512)
    mean = stat if kind == "layer" else None
    with kernels_on_cpu(), captured_launches(K, L) as got:
        K.norm_add_fwd(x, x, w, w, w, w, spec, spec, 0.5, torch.bfloat16, True, True)
        K.norm_add_bwd(x, x, x, x, w, b, w, b, stat, mean, stat, mean, spec, spec, 0.5, torch.bfloat16, True)
    assert [ln.name for ln in got] == ["_fwd_loop", "_bwd_loop", "_bwd_sum4"]
    for ln in launches + got:
        usage = resource_usage(compile_for(ln))
        # a word or two outside the loops at most, as tests/kernels/test_sm90.py allows
        assert 0 < usage["registers"] <= 255 and usage["stack"] <= 16, (ln.name, usage)


# ------------------------------------------------------------------------ bad input
def _args(d=8):
    return torch.randn(2, d), torch.randn(2, d), torch.ones(d), torch.ones(d)


@pytest.mark.parametrize("alpha, err, match", [
    (float("nan"), ValueError, "alpha"), (float("inf"), ValueError, "alpha"), ("1", TypeError, "alpha"),
    (torch.tensor(1.0), TypeError, "alpha"), (True, TypeError, "alpha"),
])
def test_bad_alpha_is_named(alpha, err, match):
    x, r, bw, w = _args()
    with pytest.raises(err, match=match):
        fuseblock.norm_add(x, r, bw, alpha=alpha)
    with pytest.raises(err, match=match):
        fuseblock.norm_add_norm(x, r, bw, w, alpha=alpha)


def test_missing_weights_where_the_kind_needs_them_are_named():
    x, r, bw, w = _args()
    for kind in ("rms", "layer"):
        with pytest.raises(ValueError, match="branch_weight"):
            fuseblock.norm_add_norm(x, r, None, w, kind=kind)
        with pytest.raises(ValueError, match="needs weight"):
            fuseblock.norm_add_norm(x, r, bw, None, kind=kind)


@pytest.mark.parametrize("call, err, match", [
    (lambda x, r, bw, w: fuseblock.norm_add(x, None, bw), TypeError, "residual"),
    (lambda x, r, bw, w: fuseblock.norm_add(x, r[:, :4], bw), ValueError, "residual"),
    (lambda x, r, bw, w: fuseblock.norm_add(x.numpy(), r, bw), TypeError, "x"),
    (lambda x, r, bw, w: fuseblock.norm_add(x, r, bw[:4]), ValueError, "weight"),
    (lambda x, r, bw, w: fuseblock.norm_add(x, r, bw, kind="batch"), ValueError, "kind"),
    (lambda x, r, bw, w: fuseblock.norm_add(x, r, bw, eps=-1.0), ValueError, "eps"),
    (lambda x, r, bw, w: fuseblock.norm_add(x, r, None, weight_offset=1.0), ValueError, "weight_offset"),
    (lambda x, r, bw, w: fuseblock.norm_add(x, r, bw, residual_dtype=torch.int32), TypeError, "residual_dtype"),
    (lambda x, r, bw, w: fuseblock.norm_add_norm(x, r, bw[:4], w), ValueError, "branch_weight"),
    (lambda x, r, bw, w: fuseblock.norm_add_norm(x, r, bw, w, bw[:3]), ValueError, "branch_bias"),
    (lambda x, r, bw, w: fuseblock.norm_add_norm(x, r, bw, w[:3]), ValueError, "weight"),
    (lambda x, r, bw, w: fuseblock.norm_add_norm(x, r, bw, w, branch_eps=-1e-3), ValueError, "branch_eps"),
    (lambda x, r, bw, w: fuseblock.norm_add_norm(x, r, bw, w, branch_eps="a"), TypeError, "branch_eps"),
    (lambda x, r, bw, w: fuseblock.norm_add_norm(x, r, bw, w, branch_weight_offset=float("nan")), ValueError,
     "branch_weight_offset"),
    (lambda x, r, bw, w: fuseblock.norm_add_norm(x, r, None, w, kind="l2", branch_weight_offset=1.0), ValueError,
     "branch_weight_offset"),
])
def test_bad_input_is_a_named_error(call, err, match):
    x, r, bw, w = _args()
    with pytest.raises(err, match=match):
        call(x, r, bw, w)


def test_eps_none_is_torchs_default():
    x, r, bw, w = _args(16)
    for kind in KINDS:
        eps = _eps(kind, torch.float32, None)
        torch.testing.assert_close(fuseblock.norm_add(x, r, bw, kind=kind),
                                   fuseblock.norm_add(x, r, bw, kind=kind, eps=eps), atol=0, rtol=0)
        got = fuseblock.norm_add_norm(x, r, bw, w, kind=kind)
        want = fuseblock.norm_add_norm(x, r, bw, w, kind=kind, eps=eps, branch_eps=eps)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.kernel
@pytest.mark.parametrize("grad", [True, False])
def test_the_fast_lane_gives_the_checked_paths_bits(grad):
    # a plain norm_add call (no [d] scales, plain tensors) is validated once per signature and
    # run with what its checks resolved; residual_scale=1.0 given (not the default's object)
    # takes the checked path: the two agree bit for bit, values and gradients
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(6, 64, generator=g).to(torch.bfloat16).requires_grad_(grad) for _ in range(2))
    w = torch.randn(64, generator=g).to(torch.bfloat16).requires_grad_(grad)
    runs = []
    for kw in ({}, dict(residual_scale=1.0)):
        for _ in range(2):  # the second call of a signature is served from the cache
            out = fuseblock.norm_add(x, r, w, kind="layer", eps=1e-6, alpha=0.5, **kw)
            grads = torch.autograd.grad(out, [x, r, w], torch.arange(64.0).expand(6, 64).to(out.dtype)) if grad else ()
            runs.append([out.detach(), *grads])
    for run in runs[1:]:
        for a, b in zip(runs[0], run, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_cached_norm_add_still_refuses_what_its_checks_refuse():
    x, r, bw, _ = _args()
    fuseblock.norm_add(x, r, bw, eps=1e-6)
    fuseblock.norm_add(x, r, bw, eps=1e-6)
    for _ in range(2):  # a refused call is never kept
        with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
            fuseblock.norm_add(x, r, bw[:4], eps=1e-6)
        with pytest.raises(ValueError, match="residual"):
            fuseblock.norm_add(x, r[:, :4], bw, eps=1e-6)
        with pytest.raises(TypeError, match="weight must be a floating tensor"):
            fuseblock.norm_add(x, r, bw.to(torch.int32), eps=1e-6)
        with pytest.raises(ValueError, match="alpha"):
            fuseblock.norm_add(x, r, bw, eps=1e-6, alpha=float("nan"))
        with pytest.raises(ValueError, match="eps"):
            fuseblock.norm_add(x, r, bw, eps=-1e-6)
