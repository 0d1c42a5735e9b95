"""add_norm's branch (issue 24.1): new_residual = residual + alpha * (drop(x) + drop(x1)),
out = N(new_residual). Values and every gradient against the fp64 reference (ref64), both
paths; the dropout masks by statistics and by regenerating them; bad input."""
import math

import pytest
import torch
from helpers import DTYPES, AllLaunches, assert_close
from ref64 import add_norm64

import fuseblock

pytestmark = pytest.mark.kernel


def _leaves(*ts):
    return [t.requires_grad_(True) for t in ts if t is not None]


def _masks(x, x1, p, seed):
    """The keep masks of x and x1 a call seeded with `seed` draws: a call on x = 1, x1 = 0
    (then x = 0, x1 = 1) of the same shapes, dtypes and strides (torch's dropout fills its
    mask in memory order) gives new_residual = keep / (1 - p)."""
    torch.manual_seed(seed)
    kx = fuseblock.add_norm(torch.ones_like(x), None, None, x1=None if x1 is None else torch.zeros_like(x1),
                            dropout_p=p)[1] != 0
    kx1 = None
    if x1 is not None:
        torch.manual_seed(seed)
        kx1 = fuseblock.add_norm(torch.zeros_like(x), None, None, x1=torch.ones_like(x1), dropout_p=p)[1] != 0
    return kx, kx1


def _check(x, x1, residual, w, b, *, kind, alpha, p=0.0, residual_dtype=None, seed=0):
    """add_norm with the branch, forward and backward, against add_norm64 on the masked inputs."""
    leaves = _leaves(x, x1, residual, w, b)
    torch.manual_seed(seed)
    out, new_res = fuseblock.add_norm(x, residual, w, b, kind=kind, alpha=alpha, x1=x1, dropout_p=p,
                                      residual_dtype=residual_dtype)
    rdtype = residual_dtype or (x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype))
    assert out.dtype == x.dtype and new_res.dtype == rdtype and new_res.shape == x.shape
    kx = kx1 = None
    rx, rx1 = x, x1
    if p > 0:
        kx, kx1 = _masks(x, x1, p, seed)
        rx = x.double() * kx / (1 - p)
        rx1 = None if x1 is None else x1.double() * kx1 / (1 - p)
    ref_out, ref_p = add_norm64(rx, residual, w, b, kind=kind, alpha=alpha, x1=rx1, residual_dtype=rdtype)
    assert_close(out, ref_out, x.dtype, "out")
    assert_close(new_res, ref_p, rdtype, "new_residual")
    g_out, g_res = torch.randn_like(out), torch.randn_like(new_res)
    grads = torch.autograd.grad((out.float() * g_out.float()).sum() + (new_res.float() * g_res.float()).sum(), leaves)
    ref_grads = torch.autograd.grad((ref_out * g_out.double()).sum() + (ref_p * g_res.double()).sum(), leaves)
    names = [n for n, t in zip(("x", "x1", "residual", "weight", "bias"), (x, x1, residual, w, b), strict=True)
             if t is not None]
    for name, leaf, g, rg in zip(names, leaves, grads, ref_grads, strict=True):
        assert g.dtype == leaf.dtype, name
        assert_close(g, rg, leaf.dtype, f"d{name}")
    return dict(zip(names, grads, strict=True)), kx, kx1


CASES = {  # (alpha, x1, residual): the branch's shapes
    "scaled": (0.37, False, "same"),
    "parallel": (1.0, True, "same"),
    "scaled_parallel_fp32_stream": (1.5, True, "fp32"),
    "scaled_no_residual": (2.0, False, "none"),
    "parallel_no_residual": (0.5, True, "none"),
}


def _inputs(case, dtype, rows, d):
    alpha, has_x1, res = CASES[case]
    x = torch.randn(rows, d).to(dtype)
    x1 = torch.randn(rows, d).to(dtype) if has_x1 else None
    residual = {"none": None, "same": torch.randn(rows, d).to(dtype), "fp32": torch.randn(rows, d)}[res]
    return alpha, x, x1, residual


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_branch_matches_fp64_reference(case, kind, dtype):
    alpha, x, x1, residual = _inputs(case, dtype, 6, 48)
    w = (1 + 0.1 * torch.randn(48)).to(dtype)
    b = (0.1 * torch.randn(48)).to(dtype) if kind == "layer" else None
    grads, _, _ = _check(x, x1, residual, w, b, kind=kind, alpha=alpha)
    if residual is not None and alpha != 1.0:  # dx = alpha * dp, dresidual = dp: returned apart
        assert not torch.equal(grads["x"], grads["residual"].to(dtype))
    if x1 is not None:  # no dropout: dx1 = dx
        assert torch.equal(grads["x"], grads["x1"])


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("has_x1", [False, True], ids=["x", "x_x1"])
def test_dropout_matches_fp64_reference_on_its_masks(kind, dtype, has_x1):
    x, residual = torch.randn(8, 40).to(dtype), torch.randn(8, 40).to(dtype)
    x1 = torch.randn(8, 40).to(dtype) if has_x1 else None
    w = (1 + 0.1 * torch.randn(40)).to(dtype)
    grads, kx, kx1 = _check(x, x1, residual, w, None, kind=kind, alpha=0.8, p=0.3, seed=7)
    # a zero gradient exactly where an element was dropped, and only there (or where dp,
    # which dresidual is, happens to be 0)
    dp_zero = grads["residual"] == 0
    assert torch.equal(grads["x"] == 0, ~kx | dp_zero)
    if has_x1:
        assert torch.equal(grads["x1"] == 0, ~kx1 | dp_zero)
        assert not torch.equal(kx, kx1)  # independent masks


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_dropout_on_an_fp32_stream(kind):
    """bf16 branches on an fp32 residual stream (dresidual fp32, apart from dx), and a bf16
    x with no residual stored as fp32 (residual_dtype)."""
    x, x1, r = torch.randn(8, 40).bfloat16(), torch.randn(8, 40).bfloat16(), torch.randn(8, 40)
    w = torch.randn(40).bfloat16()
    _check(x, x1, r, w, None, kind=kind, alpha=0.8, p=0.3, seed=3)
    _check(x, None, None, w, None, kind=kind, alpha=1.0, p=0.3, seed=4, residual_dtype=torch.float32)


def test_dropout_statistics_scale_and_seed():
    p, shape = 0.3, (128, 256)  # 32768 elements per mask
    n = shape[0] * shape[1]
    one = torch.ones(shape, requires_grad=True)
    one1 = torch.ones(shape, requires_grad=True)
    torch.manual_seed(3)
    _, new_res = fuseblock.add_norm(one, None, None, x1=torch.zeros(shape), dropout_p=p)
    kept = new_res != 0
    # the dropped fraction: p within 5 standard deviations of a binomial's
    assert abs((~kept).float().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
    # kept elements scaled by 1/(1 - p), exactly as torch's dropout scales them (fp32)
    scale = torch.nn.functional.dropout(torch.ones(4096), p)
    assert torch.equal(new_res[kept].unique(), scale[scale != 0].unique())
    # the same seed, the same mask; the next call another one
    torch.manual_seed(3)
    _, again = fuseblock.add_norm(one, None, None, x1=torch.zeros(shape), dropout_p=p)
    _, other = fuseblock.add_norm(one, None, None, x1=torch.zeros(shape), dropout_p=p)
    assert torch.equal(again, new_res) and not torch.equal(other, new_res)
    # x's and x1's masks independent: both dropped with probability p^2
    torch.manual_seed(4)
    _, both = fuseblock.add_norm(one, None, None, x1=one1, dropout_p=p)
    values = both.detach().unique()
    assert len(values) == 3  # 0, s, 2s
    frac_none = (both == 0).float().mean().item()
    assert abs(frac_none - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n)
    # the backward's mask is the forward's: the gradient of new_residual.sum() is the scale where kept
    dx, dx1 = torch.autograd.grad(both.sum(), (one, one1))
    torch.manual_seed(4)
    kx, kx1 = _masks(one, one1, p, 4)
    s = scale.max()
    assert torch.equal(dx, kx * s) and torch.equal(dx1, kx1 * s)


def test_alpha_one_and_no_dropout_is_the_plain_op():
    """alpha = 1, x1 None, dropout_p = 0 given explicitly (also as ints): the plain op's
    results, bit for bit."""
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    plain = fuseblock.add_norm(x, r, w)
    for kw in (dict(alpha=1.0, dropout_p=0.0), dict(alpha=1, dropout_p=0)):
        got = fuseblock.add_norm(x, r, w, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_strided_inputs(p):
    """x, x1, residual as views whose rows are not d apart (column slices, a transpose)."""
    d = 24
    x = torch.randn(5, 2 * d)[:, :d]
    x1 = torch.randn(d, 5).t()  # columns not unit-stride: the launcher copies it
    residual = torch.randn(5, 3 * d)[:, d:2 * d]
    w = torch.randn(d)
    _check(x, x1, residual, w, None, kind="rms", alpha=0.6, p=p, seed=2)


@pytest.mark.torch_only("gradgradcheck needs fp64, which runs the torch path")
@pytest.mark.parametrize("p", [0.0, 0.4])
def test_gradgradcheck_torch_path(p):
    x, x1, r = (torch.randn(3, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    w, b = (torch.randn(8, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def fn(x, x1, r, w, b):
        torch.manual_seed(5)  # the same masks on every evaluation
        out, new_res = fuseblock.add_norm(x, r, w, b, kind="layer", alpha=0.7, x1=x1, dropout_p=p)
        return out, new_res

    assert torch.autograd.gradcheck(fn, (x, x1, r, w, b))
    assert torch.autograd.gradgradcheck(fn, (x, x1, r, w, b))


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_create_graph_gradients_are_the_first_order_ones(p):
    """backward with create_graph=True (the kernel path's differentiable backward, which
    regenerates the masks as tensors) gives the same dx, dx1, dresidual, dw."""
    x, x1, r = (torch.randn(4, 16) for _ in range(3))
    w = torch.randn(16)
    leaves = _leaves(x, x1, r, w)
    g = torch.randn(4, 16)
    got = []
    for create_graph in (False, True):
        torch.manual_seed(9)
        out, new_res = fuseblock.add_norm(x, r, w, alpha=1.3, x1=x1, dropout_p=p)
        got.append(torch.autograd.grad((out * g).sum() + new_res.sum(), leaves, create_graph=create_graph))
    for name, a, b in zip(("x", "x1", "residual", "weight"), *got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)
    assert got[1][0].requires_grad  # a graph to differentiate again


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_compile_fullgraph_no_graph_break(p):
    def fn(x, x1, r, w):
        out, new_res = fuseblock.add_norm(x, r, w, alpha=0.5, x1=x1, dropout_p=p)
        return out * 2 + new_res

    torch._dynamo.reset()
    inputs = [torch.randn(3, 16, requires_grad=True) for _ in range(3)] + [torch.randn(16, requires_grad=True)]
    explained = torch._dynamo.explain(fn)(*inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.manual_seed(1)
    got = compiled(*inputs)
    grads = torch.autograd.grad(got.square().sum(), inputs)
    if p == 0:  # no randomness: the eager results
        want = fn(*inputs)
        torch.testing.assert_close(got, want)
        for a, b in zip(grads, torch.autograd.grad(want.square().sum(), inputs), strict=True):
            torch.testing.assert_close(a, b)
    else:  # dropped elements of x and x1 (those with no gradient) are where neither reaches new_residual
        assert ((grads[0] == 0).float().mean() - p).abs() < 0.2
        # the seed is drawn when the graph runs, not when it is traced: manual_seed
        # reproduces a compiled call, and the next call draws new masks
        torch.manual_seed(1)
        again, other = compiled(*inputs), compiled(*inputs)
        assert torch.equal(again, got) and not torch.equal(other, got)


@pytest.mark.kernel_only("counts the Triton path's launches")
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_one_launch_forward_two_backward(p, kind):
    x, x1, r = _leaves(*(torch.randn(96, 40) for _ in range(3)))
    w = _leaves(torch.randn(40))[0]
    with AllLaunches() as fwd:
        out, new_res = fuseblock.add_norm(x, r, w, kind=kind, alpha=0.9, x1=x1, dropout_p=p)
    # one kernel and nothing else on the device: with dropout the seed is drawn on the
    # host (torch.randint on the CPU) and handed to the kernel by value
    assert (fwd.kernels, fwd.ops) == (1, [])
    assert fwd.host_ops == (["randint", "_local_scalar_dense"] if p > 0 else [])
    grads = (torch.randn_like(out), torch.randn_like(new_res))
    with AllLaunches() as bwd:
        torch.autograd.grad((out, new_res), (x, x1, r, w), grads)
    assert bwd.total <= 2 and bwd.ops == [], (bwd.names, bwd.ops)
    assert bwd.host_ops == (["_local_scalar_dense"] if p > 0 else [])  # the saved seed, read on the host


@pytest.mark.kernel
def test_the_seed_is_drawn_on_the_host_whatever_the_default_device():
    """The dropout seed is a host draw under any default device: under
    torch.set_default_device("cuda") a bare randint drew it on the GPU, a second launch and
    a sync (found by the first GPU run); a meta default device shows it here."""
    x, r, w = torch.randn(8, 16), torch.randn(8, 16), torch.randn(16)
    torch.manual_seed(3)
    expected = fuseblock.add_norm(x, r, w, dropout_p=0.5)
    torch.manual_seed(3)
    with torch.device("meta"):
        got = fuseblock.add_norm(x, r, w, dropout_p=0.5)
    for a, b in zip(got, expected, strict=True):
        assert a.device == x.device and torch.equal(a, b)


@pytest.mark.kernel_only("the wide-row kernels")
@pytest.mark.usefixtures("small_wide_rows")
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("res", ["none", "same"])
def test_wide_rows(kind, p, res, launches):
    # 13 rows of 37 (small_wide_rows): 5 column chunks, the last ragged, and 4 row blocks
    # (7 with dropout's smaller blocks) over 3 programs per chunk, so a program takes two
    # or more; few rows, as each element's
    # Philox draw is slow in the interpreter
    # With a residual, x and x1 (pass 2 of fwd_loop reads new_residual back); without,
    # x alone, nothing to add: pass 2 reads x again, regenerating its mask
    d, rows = 37, 13
    x = torch.randn(rows, d) * 3 + 2
    x1, residual = (None, None) if res == "none" else (torch.randn(rows, d), torch.randn(rows, d))
    w = torch.randn(d)
    b = torch.randn(d) if kind == "layer" else None
    _check(x, x1, residual, w, b, kind=kind, alpha=0.75 if res == "same" else 1.25, p=p, seed=11)
    with AllLaunches() as run:
        fuseblock.add_norm(x, residual, w, b, kind=kind, alpha=0.75, x1=x1, dropout_p=p)
    from fuseblock.kernels.launch import fwd_layout  # triton: the kernel path only

    # one launch, of the loop kernel (the interpreter names it; a GPU run counts it)
    assert run.kernels == 1 and not fwd_layout(d).tile
    assert run.names in (None, ["fwd_loop"])


@pytest.mark.parametrize("alpha", [math.inf, -math.inf, math.nan])
def test_alpha_not_finite(alpha):
    with pytest.raises(ValueError, match="alpha"):
        fuseblock.add_norm(torch.randn(2, 8), torch.randn(2, 8), alpha=alpha)


@pytest.mark.parametrize("alpha", ["2", torch.tensor(2.0), True, None])
def test_alpha_not_a_number(alpha):
    with pytest.raises(TypeError, match="alpha"):
        fuseblock.add_norm(torch.randn(2, 8), torch.randn(2, 8), alpha=alpha)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, math.nan])
def test_dropout_p_outside_0_1(p):
    with pytest.raises(ValueError, match="dropout_p"):
        fuseblock.add_norm(torch.randn(2, 8), torch.randn(2, 8), dropout_p=p)


def test_dropout_p_not_a_number():
    with pytest.raises(TypeError, match="dropout_p"):
        fuseblock.add_norm(torch.randn(2, 8), torch.randn(2, 8), dropout_p="0.1")


@pytest.mark.parametrize("x1, error", [
    (torch.randn(2, 4), ValueError),  # another shape
    (torch.randn(8), ValueError),  # broadcastable, still another shape
    (torch.randn(2, 8, dtype=torch.float64), TypeError),  # another dtype
    ([[0.0] * 8] * 2, TypeError),  # not a tensor
])
def test_x1_not_like_x(x1, error):
    with pytest.raises(error, match="x1"):
        fuseblock.add_norm(torch.randn(2, 8), torch.randn(2, 8), x1=x1)



@pytest.mark.kernel_only("the custom ops serve the Triton path")
def test_custom_ops_schema_and_fakes_with_the_branch():
    """The registered ops with x1, a seed and dx1: their fakes give what the kernels return."""
    from fuseblock.ops.norm import norm_op
    from fuseblock.spec import Act, Gate, NormSpec

    x, x1, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    spec = NormSpec(True, 1.0, 1e-6, Gate.NONE, Act.UNUSED, 1, alpha=0.5, dropout_p=0.2).pack()
    fwd_args = (x, r, None, w, None, spec, torch.float32, True, x1, seed)
    torch.library.opcheck(norm_op.fwd_op, fwd_args, test_utils=("test_schema", "test_faketensor"))
    _, new_res, rstd, mean = norm_op.fwd_op(*fwd_args)
    bwd_args = (torch.randn_like(x), torch.randn_like(x), new_res, None, w, None, rstd, mean, spec, x.dtype,
                torch.float32, seed, True)
    torch.library.opcheck(norm_op.bwd_op, bwd_args, test_utils=("test_schema", "test_faketensor"))
    dx, dr, _, _, _, dx1, drs, dbs = norm_op.bwd_op(*bwd_args)
    assert dx.shape == dr.shape == dx1.shape == x.shape and drs.numel() == dbs.numel() == 0  # empty: no scales


@pytest.mark.kernel_only("the Triton launchers' seed argument")
def test_seed_by_pointer_gives_the_masks_of_the_seed_by_value():
    """The kernels take the seed by value (drawn on the host) or, as while a CUDA graph is
    captured, by pointer to a one-element int64 tensor: the same masks either way, forward
    and backward."""
    from fuseblock.ops.dispatch import kernels
    from fuseblock.spec import Act, Gate, NormSpec

    launch = kernels("norm", torch.empty(0))
    x, x1, r, w = torch.randn(6, 24), torch.randn(6, 24), torch.randn(6, 24), torch.randn(24)
    spec = NormSpec(True, 1.0, 1e-6, Gate.NONE, Act.UNUSED, 1, alpha=0.5, dropout_p=0.4)
    seed = 123456789012345
    by_value = launch.norm_fwd(x, r, None, w, None, spec, torch.float32, True, x1, seed)
    by_pointer = launch.norm_fwd(x, r, None, w, None, spec, torch.float32, True, x1, torch.tensor([seed]))
    assert all(torch.equal(a, b) for a, b in zip(by_value, by_pointer, strict=True))
    assert not torch.equal(by_value[1], launch.norm_fwd(x, r, None, w, None, spec, torch.float32, True, x1,
                                                        seed + 1)[1])
    _, new_res, rstd, mean = by_value  # spec: a layer norm (center)
    g = torch.randn(6, 24)
    grads = [launch.norm_bwd(g, g, new_res, None, w, None, rstd, mean, spec, x.dtype, torch.float32, s, True)
             for s in (seed, torch.tensor([seed]))]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True) if a is not None)


@pytest.mark.kernel_only("what the Triton path's backward keeps")
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_saved_for_backward_is_p_statistics_and_the_seed(kind):
    """With dropout on x and x1 the backward keeps p, the weight, the row statistics and
    one int64 seed: no mask, and neither x nor x1."""
    x, x1, r = _leaves(*(torch.randn(8, 32) for _ in range(3)))
    w = _leaves(torch.randn(32))[0]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _, new_res = fuseblock.add_norm(x, r, w, kind=kind, alpha=0.9, x1=x1, dropout_p=0.5)
    full = [t for t in saved if t.shape == x.shape]
    assert len(full) == 1 and full[0].data_ptr() == new_res.data_ptr()  # p is new_residual, nothing else row-sized
    (seed,) = [t for t in saved if t.dtype == torch.int64]
    assert seed.numel() == 1
    assert sum(t.numel() for t in saved) == x.numel() + 32 + 8 * (2 if kind == "layer" else 1) + 1
