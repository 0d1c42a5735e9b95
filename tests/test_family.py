"""The rest of the normalization family (docs/family.md): embedding norms, group norm through
num_groups, and batch / instance / group norm of (N, C, L) inputs.

Everything is checked against torch's own functions in float64 (F.normalize,
F.group_norm, F.batch_norm, F.instance_norm, the nn modules), values and gradients,
and the "max" embedding norm also against its fp64 formula.
"""
import pytest
import torch
import torch.nn.functional as F
from helpers import KERNEL_PATH, assert_close
from ref64 import leaf64

import fuseblock
from fuseblock.kernels.launch import MAX_TILE_FWD, fwd_layout
from fuseblock.ops.batch_norm import channel_norm_op
from fuseblock.ops.embed_norm import embed_norm_op
from fuseblock.ops.norm import uses_triton

HALF = [torch.float16, torch.bfloat16]
WIDE = MAX_TILE_FWD + 8  # a row the core op's and embed_norm's layouts hand to the loop kernels


def loops(d, groups=1):
    """Whether rows of d in `groups` take the loop kernels (forward, hence backward too)."""
    return not fwd_layout(d, groups).tile
P = {"l1": 1.0, "l2": 2.0, "max": float("inf")}

# assert_close(..., per_row=True) throughout this module: rows of very different sizes
# (a clamped zero row's gradient is dy / eps) are each held to their own scale.


def check_grads(out, ref_out, leaves, refs, dtype, names):
    """Backprop one random cotangent through both and compare every leaf's gradient."""
    g = torch.randn(out.shape, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * g).sum(), leaves)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), refs)
    for name, a, b, leaf in zip(names, grads, ref_grads, leaves, strict=False):
        assert a.dtype == leaf.dtype, name
        assert_close(a, b, dtype, f"d{name}", per_row=True)


# =========================================================================== embed_norm
def _stat64(x, ord):
    return {"l1": lambda: x.abs().sum(-1), "l2": lambda: x.norm(dim=-1), "max": lambda: x.abs().amax(-1)}[ord]()


def _with_norms(shape, ord, targets, dtype):
    """Random rows rescaled so that row i has norm targets[i % len(targets)]."""
    x = torch.randn(shape, dtype=torch.float64)
    t = torch.tensor(targets, dtype=torch.float64).repeat(x[..., 0].numel())[: x[..., 0].numel()]
    return (x / _stat64(x, ord)[..., None] * t.view(shape[:-1] + (1,))).to(dtype)


def run_embed(x, ord, eps):
    """embed_norm vs F.normalize in fp64 (and the formula for max), values and gradients."""
    x = x.detach().requires_grad_(True)  # a view: keeps x's strides
    y = fuseblock.embed_norm(x, ord, eps)
    assert y.dtype == x.dtype and y.shape == x.shape
    x64 = leaf64(x)
    ref = F.normalize(x64, p=P[ord], dim=-1, eps=eps)
    assert_close(y, ref, x.dtype, "y", per_row=True)
    check_grads(y, ref, [x], [x64], x.dtype, ["x"])
    if ord == "max":  # the fp64 formula x / max(max|x|, eps), by plain autograd
        x64b = leaf64(x)
        formula = x64b / x64b.abs().amax(-1, keepdim=True).clamp_min(eps)
        y2 = fuseblock.embed_norm(x, ord, eps)  # a second graph: the first one was consumed
        assert_close(y2, formula, x.dtype, "y (formula)", per_row=True)
        check_grads(y2, formula, [x], [x64b], x.dtype, ["x (formula)"])
    return y


@pytest.mark.kernel
@pytest.mark.parametrize("ord", list(P))
@pytest.mark.parametrize("dtype", [torch.float32] + HALF, ids=str)
@pytest.mark.parametrize("d", [1, 7, 300])
@pytest.mark.parametrize("eps", [1e-12, 1.0])
def test_embed_norm_matches_normalize(ord, dtype, d, eps):
    # norms 0.25 and 4: with eps = 1 some rows are clamped, far from the switch
    run_embed(_with_norms((3, 4, d), ord, [0.25, 4.0, 4.0], dtype), ord, eps)


@pytest.mark.kernel
@pytest.mark.parametrize("ord", list(P))
def test_embed_norm_wide_rows_loop_over_column_blocks(ord):
    assert loops(WIDE)
    x = _with_norms((3, WIDE), ord, [0.25, 40.0, 40.0], torch.float32)
    x[2, 100], x[2, WIDE - 10] = x[2].abs().max(), -x[2].abs().max()  # a tie across chunks for max
    run_embed(x, ord, 1.0)


@pytest.mark.kernel
@pytest.mark.parametrize("ord", list(P))
@pytest.mark.parametrize("d", [4, WIDE])
def test_embed_norm_subgradients_at_kinks(ord, d):
    # rows: exactly at the clamp (n = eps = 0.5 for every ord), a tie for max|x|,
    # zero, below the clamp. Zero padding leaves every norm unchanged.
    x = torch.zeros(4, d)
    x[:, :4] = torch.tensor([[0.5, 0, 0, 0], [3.0, -3.0, 1.0, 0], [0, 0, 0, 0], [0.1, -0.2, 0.05, 0]])
    run_embed(x, ord, 0.5)


@pytest.mark.kernel
def test_embed_norm_seed_example():
    v = torch.tensor([3.0, 4.0])
    for ord, expected in (("l1", [3 / 7, 4 / 7]), ("l2", [0.6, 0.8]), ("max", [0.75, 1.0])):
        torch.testing.assert_close(fuseblock.embed_norm(v, ord), torch.tensor(expected))
    # a zero row stays zero with the default eps: no division by zero
    assert torch.equal(fuseblock.embed_norm(torch.zeros(2, 3)), torch.zeros(2, 3))


@pytest.mark.kernel
def test_embed_norm_non_contiguous_and_empty():
    for x in (torch.randn(40, 6).t(), torch.randn(5, 16)[:, ::2]):  # last-dim strides 6, 2
        assert x.stride(-1) > 1
        run_embed(x, "max", 1e-12)
    x = torch.randn(0, 16, requires_grad=True)
    fuseblock.embed_norm(x, "l1").sum().backward()
    assert x.grad.shape == (0, 16)


@pytest.mark.kernel
@pytest.mark.kernel_only("launch counts are a property of the Triton path")
def test_embed_norm_one_launch_each_way(launches):
    x = torch.randn(8, 64, requires_grad=True)
    assert uses_triton(x)
    launches.reset()
    y = fuseblock.embed_norm(x, "max")
    assert launches["embed_fwd"] == 1
    y.sum().backward()
    assert launches["embed_bwd"] == 1


@pytest.mark.parametrize("ord", list(P))
def test_embed_norm_gradcheck_float64(ord):
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    x.data[2] *= 0.01  # a clamped row (eps = 0.1)
    assert torch.autograd.gradcheck(lambda t: fuseblock.embed_norm(t, ord, 0.1), (x,))


@pytest.mark.kernel
def test_compile_fullgraph_traces_embed_and_batch_norm():
    torch._dynamo.reset()

    def fn(x, rm, rv, w, b):
        y = fuseblock.batch_norm(x, rm, rv, w, b, training=True, momentum=0.5)
        return fuseblock.embed_norm(y, "max") * 2

    def make():  # (leaves x, w, b), running buffers, fn's arguments
        torch.manual_seed(1)
        x, w, b = leaves = [torch.randn(*s, requires_grad=True) for s in ((6, 4, 5), (4,), (4,))]
        rm, rv = torch.zeros(4), torch.ones(4)
        return leaves, (rm, rv), (x, rm, rv, w, b)

    explained = torch._dynamo.explain(fn)(*make()[2])
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    graph = str(explained.graphs[0].graph)
    if KERNEL_PATH:
        assert "fuseblock.embed_norm_fwd" in graph and "fuseblock.channel_norm_fwd" in graph
    else:  # plain torch ops
        assert "fuseblock" not in graph
    results = []
    for f in (torch.compile(fn, fullgraph=True, backend="aot_eager"), fn):
        leaves, buffers, args = make()
        out = f(*args)
        results.append([out, *buffers, *torch.autograd.grad(out.square().sum(), leaves)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.kernel
@pytest.mark.kernel_only("the custom ops serve the Triton path")
def test_embed_norm_opcheck_fake_implementations():
    x = torch.randn(3, 16, requires_grad=True)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(embed_norm_op.fwd_op, (x, 3, 1e-12), test_utils=tests)
    _, n = embed_norm_op.fwd_op(x.detach(), 2, 1e-12)
    torch.library.opcheck(embed_norm_op.bwd_op, (torch.randn(3, 16), x.detach(), n, 2, 1e-12))


EMBED_BAD = [
    ("x", dict(x=[1.0, 2.0]), TypeError),
    ("x", dict(x=torch.ones(2, 3, dtype=torch.int64)), TypeError),
    ("x", dict(x=torch.tensor(1.0)), ValueError),
    ("x", dict(x=torch.ones(2, 0)), ValueError),
    ("ord", dict(ord="l3"), ValueError),
    ("ord", dict(ord=2), ValueError),
    ("eps", dict(eps=-1e-12), ValueError),
    ("eps", dict(eps=float("nan")), ValueError),
    ("eps", dict(eps="1e-12"), TypeError),
]


@pytest.mark.parametrize("argument,kwargs,exc", EMBED_BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(EMBED_BAD)])
def test_embed_norm_bad_input_names_the_argument(argument, kwargs, exc):
    kw = dict(x=torch.randn(2, 3), **kwargs) if "x" not in kwargs else dict(kwargs)
    with pytest.raises(exc, match=argument):
        fuseblock.embed_norm(**kw)


# =========================================================================== group norm via num_groups
@pytest.mark.kernel
@pytest.mark.parametrize("num_groups", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_with_groups_is_group_norm(num_groups, dtype, residual):
    # groups of >= 4 values: a group of 2 normalizes to +-1, and its gradient is all
    # cancellation (ill-conditioned in any precision, torch's own fp32 included)
    x, r = torch.randn(5, 16).to(dtype), torch.randn(5, 16).to(dtype)
    w, b = torch.randn(16).to(dtype), torch.randn(16).to(dtype)
    leaves = [t.requires_grad_(True) for t in ((x, r, w, b) if residual else (x, w, b))]
    out, _ = fuseblock.add_norm(x, r if residual else None, w, b, kind="layer", eps=1e-5, num_groups=num_groups)
    refs = [leaf64(t) for t in leaves]
    p = refs[0] + refs[1] if residual else refs[0]
    ref = F.group_norm(p, num_groups, refs[-2], refs[-1], 1e-5)
    assert_close(out, ref, dtype, "out", per_row=True)
    check_grads(out, ref, leaves, refs, dtype, ["x", "residual", "w", "b"] if residual else ["x", "w", "b"])


@pytest.mark.kernel
def test_group_norm_wide_groups_loop_kernel():
    assert loops(WIDE, 2)
    x, w, b = torch.randn(3, WIDE), torch.randn(WIDE), torch.randn(WIDE)
    leaves = [t.requires_grad_(True) for t in (x, w, b)]
    out = fuseblock.norm(x, w, b, kind="layer", eps=1e-5, num_groups=2)
    refs = [leaf64(t) for t in leaves]
    ref = F.group_norm(refs[0], 2, refs[1], refs[2], 1e-5)
    assert_close(out, ref, torch.float32, "out", per_row=True)
    check_grads(out, ref, leaves, refs, torch.float32, ["x", "w", "b"])


@pytest.mark.kernel
@pytest.mark.parametrize("num_groups", [2, 4])
def test_norm_module_with_groups_loads_nn_group_norm(num_groups):
    ref = torch.nn.GroupNorm(num_groups, 16, eps=1e-5)
    torch.nn.init.normal_(ref.weight)
    torch.nn.init.normal_(ref.bias)
    mod = fuseblock.Norm(16, kind="layer", eps=1e-5, bias=True, num_groups=num_groups)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(6, 16, requires_grad=True)
    out, ref_out = mod(x), ref(x)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, mod.weight, mod.bias), g)
    for a, b in zip(grads, torch.autograd.grad(ref_out, (x, ref.weight, ref.bias), g), strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_groups_must_divide_the_last_dim():
    x = torch.randn(2, 6)
    with pytest.raises(ValueError, match="num_groups"):
        fuseblock.norm(x, kind="layer", num_groups=4)
    with pytest.raises(ValueError, match="num_groups"):
        fuseblock.add_norm(x, x, kind="layer", num_groups=5)
    with pytest.raises(ValueError, match="num_groups"):
        fuseblock.Norm(6, kind="layer", num_groups=4)


# =========================================================================== batch norm
def run_batch_norm(shape, dtype=torch.float32, affine=True, stats=True, training=True, momentum=0.3):
    """fuseblock.batch_norm vs F.batch_norm in fp64: output, running buffers, gradients."""
    c = shape[1]
    x = (torch.randn(shape) * 2 + 1).to(dtype)
    w, b = (torch.randn(c), torch.randn(c)) if affine else (None, None)
    rm, rv = (torch.randn(c), torch.rand(c) + 0.5) if stats else (None, None)
    leaves = [t.requires_grad_(True) for t in (x, w, b) if t is not None]
    mine = [None if t is None else t.clone() for t in (rm, rv)]
    ref_stats = [None if t is None else t.double() for t in (rm, rv)]
    y = fuseblock.batch_norm(x, *mine, w, b, training, momentum, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    refs = [leaf64(t) for t in leaves]
    ref = F.batch_norm(refs[0], *ref_stats, *(refs[1:] if affine else (None, None)), training, momentum, 1e-5)
    assert_close(y, ref, dtype, "y", per_row=True)
    if stats:
        assert_close(mine[0], ref_stats[0], torch.float32, "running_mean", per_row=True)
        assert_close(mine[1], ref_stats[1], torch.float32, "running_var", per_row=True)
        if not training:
            assert torch.equal(mine[0], rm) and torch.equal(mine[1], rv)
    check_grads(y, ref, leaves, refs, dtype, ["x", "w", "b"])


@pytest.mark.kernel
@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5), (1, 3, 7), (2, 3, 2, 3)], ids=str)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("stats", [True, False])
def test_batch_norm_training_matches_torch(shape, affine, stats):
    run_batch_norm(shape, affine=affine, stats=stats)


@pytest.mark.kernel
@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5), (2, 3, 2, 3)], ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_eval_uses_running_stats(shape, affine):
    run_batch_norm(shape, affine=affine, training=False)


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_half_input_fp32_parameters(dtype, training):
    run_batch_norm((4, 3, 6), dtype=dtype, training=training)


@pytest.mark.kernel
def test_batch_norm_long_channels_loop_kernel():
    assert loops(2 * WIDE)
    run_batch_norm((2, 2, WIDE))  # rows of N*L values: the core op's loop kernels


def test_batch_norm_gradcheck_float64():
    x, w, b = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((4, 3, 2), (3,), (3,)))
    assert torch.autograd.gradcheck(lambda *t: fuseblock.batch_norm(t[0], None, None, t[1], t[2], True), (x, w, b))


@pytest.mark.kernel
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(8, 4), (4, 4, 6)], ids=str)
def test_batch_norm_module_tracks_like_nn_batchnorm1d(momentum, shape):
    ref = torch.nn.BatchNorm1d(4, momentum=momentum)
    mod = fuseblock.BatchNorm(4, momentum=momentum)
    assert list(mod.state_dict()) == list(ref.state_dict())
    torch.nn.init.normal_(ref.weight)
    mod.load_state_dict(ref.state_dict())
    for _ in range(3):  # training steps move the running stats
        x = torch.randn(shape) * 3 + 2
        torch.testing.assert_close(mod(x), ref(x), atol=2e-5, rtol=2e-5)
    x = torch.randn(shape, requires_grad=True)
    for m in (mod, ref):
        m.eval()
    out, ref_out = mod(x), ref(x)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x), torch.autograd.grad(ref_out.sum(), x))
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(mod.state_dict()[key], value, atol=1e-6, rtol=1e-5)
    ref.load_state_dict(mod.state_dict())  # and back


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_module_without_running_stats(affine):
    ref = torch.nn.BatchNorm1d(3, affine=affine, track_running_stats=False)
    mod = fuseblock.BatchNorm(3, affine=affine, track_running_stats=False)
    assert list(mod.state_dict()) == list(ref.state_dict())
    x = torch.randn(5, 3, 4)
    for m in (mod, ref):
        m.eval()  # still batch statistics: there are no running ones
    torch.testing.assert_close(mod(x), ref(x), atol=2e-5, rtol=2e-5)


# =========================================================================== group and instance norm of (N, C, L)
@pytest.mark.kernel
@pytest.mark.parametrize("num_groups", [1, 2, 4])
def test_group_norm_of_channels_matches_torch(num_groups):
    x, w, b = torch.randn(3, 4, 5), torch.randn(4), torch.randn(4)
    leaves = [t.requires_grad_(True) for t in (x, w, b)]
    out = fuseblock.group_norm(x, num_groups, w, b, 1e-5)
    refs = [leaf64(t) for t in leaves]
    ref = F.group_norm(refs[0], num_groups, refs[1], refs[2], 1e-5)
    assert_close(out, ref, torch.float32, "out", per_row=True)
    check_grads(out, ref, leaves, refs, torch.float32, ["x", "w", "b"])


@pytest.mark.kernel
@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 3, 2, 3)], ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_instance_norm_matches_torch(shape, affine):
    c = shape[1]
    x = torch.randn(shape)
    w, b = (torch.randn(c), torch.randn(c)) if affine else (None, None)
    leaves = [t.requires_grad_(True) for t in (x, w, b) if t is not None]
    out = fuseblock.instance_norm(x, w, b, 1e-5)
    refs = [leaf64(t) for t in leaves]
    ref = F.instance_norm(refs[0], weight=refs[1] if affine else None, bias=refs[2] if affine else None, eps=1e-5)
    assert_close(out, ref, torch.float32, "out", per_row=True)
    check_grads(out, ref, leaves, refs, torch.float32, ["x", "w", "b"])


def test_instance_norm_module_loads_nn_instance_norm():
    ref = torch.nn.InstanceNorm1d(4, affine=True)
    torch.nn.init.normal_(ref.weight)
    mod = fuseblock.InstanceNorm(4, affine=True)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4, 7)
    torch.testing.assert_close(mod(x), ref(x), atol=2e-5, rtol=2e-5)
    assert list(fuseblock.InstanceNorm(4).state_dict()) == list(torch.nn.InstanceNorm1d(4).state_dict()) == []


# =========================================================================== the channel-norm kernels
# fuseblock.kernels.channel_norm on the kernel path (one program per normalized set, the
# affine per channel), the torch path's ops elsewhere: values, gradients and running
# buffers against torch's functions and an fp64 formula of their own.
CHANNEL = ["batch", "group", "instance"]


@pytest.fixture
def small_channel_blocks(monkeypatch):
    """Blocks of 16 elements: sets of a few dozen values loop over rows and columns."""
    import fuseblock.kernels.channel_norm as K

    monkeypatch.setattr(K, "FWD_BLOCK", 16)
    monkeypatch.setattr(K, "BWD_BLOCK", 16)


def _groups(x):
    """Group norm's groups: of two channels, or of four for (N, C) inputs, so that no set
    has fewer than 4 values (a set of 2 normalizes to +-1, its gradient all cancellation)."""
    return x.shape[1] // (2 if x[0, 0].numel() > 1 else 4)


def _channel(op, x, w, b, running=(None, None), momentum=0.3, fn=fuseblock):
    """One channel norm by `fn`: fuseblock, or torch.nn.functional (batch norm: training)."""
    if op == "batch":
        return fn.batch_norm(x, *running, w, b, training=True, momentum=momentum, eps=1e-5)
    if op == "group":
        return fn.group_norm(x, _groups(x), w, b, eps=1e-5)
    return fn.instance_norm(x, weight=w, bias=b, eps=1e-5)


def _channel64(op, x, w, b):
    """The fp64 formula: each set's mean and biased variance, then the per-channel affine."""
    n, c = x.shape[:2]
    x3 = x.reshape(n, c, -1)
    sets = {"batch": x3.transpose(0, 1).reshape(c, -1), "group": x3.reshape(n * _groups(x), -1),
            "instance": x3.reshape(n * c, -1)}[op]
    y = (sets - sets.mean(-1, keepdim=True)) / torch.sqrt(sets.var(-1, unbiased=False, keepdim=True) + 1e-5)
    y = y.view(c, n, -1).transpose(0, 1) if op == "batch" else y.view(n, c, -1)
    if w is not None:
        y = y * w[:, None]
    if b is not None:
        y = y + b[:, None]
    return y.reshape(x.shape)


def run_channel(op, x, affine=True, param_dtype=None, momentum=0.3):
    """fuseblock's channel norm of x (any strides) against F's and the fp64 formula: y,
    dx, dw, db, and batch norm's running buffers."""
    c = x.shape[1]
    dtype = x.dtype
    w, b = (torch.randn(c).to(param_dtype or dtype), torch.randn(c).to(param_dtype or dtype)) if affine \
        else (None, None)
    running = (torch.randn(c), torch.rand(c) + 0.5) if op == "batch" else (None, None)
    mine = [None if t is None else t.clone() for t in running]
    versions = [None if t is None else t._version for t in mine]
    x = x.detach().requires_grad_()  # a view keeps its strides
    leaves = [t.requires_grad_(True) for t in (x, w, b) if t is not None]
    y = _channel(op, x, w, b, mine, momentum)
    for t, version in zip(mine, versions, strict=True):  # updated in place, as autograd sees it
        assert t is None or t._version > version
    assert y.dtype == dtype and y.shape == x.shape
    dy = torch.randn(y.shape, dtype=torch.float64)
    grads = torch.autograd.grad((y.double() * dy).sum(), leaves)
    run64 = [None if t is None else t.double() for t in running]
    for what, ref_fn in (("F", lambda r: _channel(op, r[0], *r[1:], run64, momentum, F)),
                         ("fp64 formula", lambda r: _channel64(op, *r))):
        refs = [leaf64(t) for t in (x, w, b)]
        ref = ref_fn(refs)
        assert_close(y, ref, dtype, f"y ({what})", per_row=True)
        ref_grads = torch.autograd.grad((ref * dy).sum(), [t for t in refs if t is not None])
        for name, leaf, g, rg in zip("xwb", leaves, grads, ref_grads, strict=False):
            assert g.dtype == leaf.dtype, name
            assert_close(g, rg, dtype, f"d{name} ({what})", per_row=True)
    for got, want in zip(mine, run64, strict=True):  # as F updated them
        if got is not None:
            assert_close(got, want, torch.float32, "running buffer")
    return y


CHANNEL_SHAPES = {"batch": [(6, 4), (3, 4, 5), (2, 6, 3, 7)], "group": [(6, 4), (3, 4, 5), (2, 6, 3, 7)],
                  "instance": [(3, 4, 5), (2, 6, 3, 7)]}


@pytest.mark.kernel
@pytest.mark.parametrize("op,shape", [(op, s) for op in CHANNEL for s in CHANNEL_SHAPES[op]], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32] + HALF, ids=str)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_channel_norms_match_torch_and_fp64(op, shape, dtype, affine):
    # (N, C) with L = 1, L = 5 and L = 21 (not powers of two), (N, C, H, W)
    run_channel(op, (torch.randn(shape) * 2 + 1).to(dtype), affine)


@pytest.mark.kernel
@pytest.mark.usefixtures("small_channel_blocks")
@pytest.mark.parametrize("op", CHANNEL)
@pytest.mark.parametrize("shape", [(5, 4, 37), (40, 4), (3, 18, 2, 3)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_channel_norms_loop_over_blocks_of_long_sets(op, shape, dtype):
    # blocks of 16: batch norm's sets of 185 and 40 values and group norm's 18-channel
    # groups loop over rows, L = 37 over ragged column blocks too
    if op == "instance" and len(shape) == 2:
        pytest.skip("instance norm takes (N, C, L)")
    run_channel(op, (torch.randn(shape) * 3 - 2).to(dtype), param_dtype=torch.float32)


@pytest.mark.kernel
@pytest.mark.parametrize("op", CHANNEL)
@pytest.mark.parametrize("how", ["transposed", "sliced", "permuted"])
def test_channel_norms_of_non_contiguous_inputs(op, how):
    # transposed: (C, N, L) storage, viewed (N, C, L); sliced: every other value of L;
    # permuted: (N, H, W, C) storage, whose trailing dims cannot be viewed as one L
    base = torch.randn(4, 6, 10)
    x = {"transposed": lambda: base.transpose(0, 1), "sliced": lambda: base[:, :, ::2],
         "permuted": lambda: base.view(4, 5, 2, 6).permute(0, 3, 1, 2)}[how]()
    assert not x.is_contiguous()
    torch.manual_seed(0)
    y = run_channel(op, x)
    torch.manual_seed(0)
    torch.testing.assert_close(y, run_channel(op, x.contiguous()), rtol=1e-6, atol=1e-6)


@pytest.mark.kernel
@pytest.mark.parametrize("op", CHANNEL)
@pytest.mark.parametrize("dtype", [torch.float32] + HALF, ids=str)
@pytest.mark.parametrize("blocks", ["one_block", "small_blocks"])
def test_a_constant_set_gives_exactly_the_bias(op, dtype, blocks, request):
    if blocks == "small_blocks":
        request.getfixturevalue("small_channel_blocks")
    # the set made constant: channel 1 (batch norm), sample 1's second group of two
    # channels (group norm), sample 0's channel 1 (instance norm)
    where = {"batch": (slice(None), slice(1, 2)), "group": (1, slice(2, 4)), "instance": (0, slice(1, 2))}[op]
    x = torch.randn(3, 4, 21).to(dtype)
    x[where] = 3.7
    w, b = torch.randn(4).to(dtype), torch.randn(4).to(dtype)
    y = _channel(op, x, w, b)
    assert torch.equal(y[where], b[where[1], None].expand_as(y[where]))


@pytest.mark.kernel
@pytest.mark.usefixtures("small_channel_blocks")
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_norm_module_running_stats_over_long_sets(momentum, dtype):
    # momentum None: nn.BatchNorm1d's cumulative average, momentum = 1 / num_batches_tracked
    ref = torch.nn.BatchNorm1d(3, momentum=momentum)
    mod = fuseblock.BatchNorm(3, momentum=momentum)
    mod.load_state_dict(ref.state_dict())
    for _ in range(3):
        x = (torch.randn(5, 3, 37) * 3 + 2).to(dtype)
        assert_close(mod(x), ref(x.float()), dtype, "y", per_row=True)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(mod.state_dict()[key], value, atol=1e-6, rtol=1e-5)


@pytest.mark.kernel
def test_group_norm_of_an_empty_batch():
    x = torch.randn(0, 4, 5, requires_grad=True)
    w, b = torch.randn(4, requires_grad=True), torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    y = fuseblock.group_norm(x, 2, w, b)
    assert y.shape == x.shape
    for leaf, g in zip((x, w, b), torch.autograd.grad(y.sum(), (x, w, b)), strict=True):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape and not g.any()


@pytest.mark.kernel
@pytest.mark.parametrize("op", ["batch", "group"])
def test_channel_norms_second_derivatives_match_torch(op):
    # create_graph=True: the first derivatives rebuilt from torch's own norm, differentiable
    x, w, b = (torch.randn(*s, dtype=torch.float64) for s in ((3, 4, 5), (4,), (4,)))
    results = []
    for fn, dtype in ((fuseblock, torch.float32), (F, torch.float64)):
        leaves = [t.to(dtype).requires_grad_() for t in (x, w, b)]
        y = _channel(op, *leaves, fn=fn)
        gx, gw = torch.autograd.grad(y.square().sum(), leaves[:2], create_graph=True)
        results.append(torch.autograd.grad(gx.sin().sum() + gw.square().sum(), leaves))
    for name, a, ref in zip("xwb", *results, strict=True):
        # cond 4: torch's fp32 double backward of group norm (what the rebuild runs) sums
        # terms a few times the result's size
        assert_close(a, ref, torch.float32, f"d2 {name}", cond=4.0)


@pytest.mark.kernel
@pytest.mark.kernel_only("the custom ops serve the Triton path")
def test_channel_norm_opcheck_fake_implementations():
    x, w = torch.randn(3, 4, 5, requires_grad=True), torch.randn(4)
    torch.library.opcheck(channel_norm_op.fwd_op, (x, w, None, False, 2, 1e-5))
    _, mean, rstd = channel_norm_op.fwd_op(x.detach(), w, None, True, 0, 1e-5)
    torch.library.opcheck(channel_norm_op.bwd_op,
                          (torch.randn(3, 4, 5), x.detach(), w, None, mean, rstd, True, 0))


X3 = torch.randn(4, 3, 5)
C3 = torch.ones(3)
META = torch.ones(3, device="meta")
BN_BAD = [
    ("x", dict(x=X3.long()), TypeError),
    ("x", dict(x=torch.randn(4)), ValueError),
    ("x", dict(x=torch.randn(1, 3), training=True), ValueError),  # one value per channel
    ("running_mean", dict(running_mean=torch.zeros(4)), ValueError),
    ("running_var", dict(running_var=torch.ones(3, 1)), ValueError),
    ("running_mean", dict(running_mean=torch.zeros(3, dtype=torch.int64)), TypeError),
    ("running_mean", dict(running_mean=None, running_var=None, training=False), ValueError),
    ("running_var", dict(running_var=None, training=True), ValueError),  # only one given
    ("weight", dict(weight=torch.ones(4)), ValueError),
    ("weight", dict(weight=META), ValueError),  # device mismatch
    ("bias", dict(bias=torch.ones(3, dtype=torch.int32)), TypeError),
    ("training", dict(training=1), TypeError),
    ("momentum", dict(momentum=1.5), ValueError),
    ("momentum", dict(momentum="0.1"), TypeError),
    ("eps", dict(eps=-1.0), ValueError),
]


@pytest.mark.parametrize("argument,kwargs,exc", BN_BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(BN_BAD)])
def test_batch_norm_bad_input_names_the_argument(argument, kwargs, exc):
    args = dict(x=X3, running_mean=torch.zeros(3), running_var=torch.ones(3), weight=C3, bias=C3)
    args.update(kwargs)
    with pytest.raises(exc, match=argument):
        fuseblock.batch_norm(**args)


def test_channel_norms_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="num_groups"):
        fuseblock.group_norm(torch.randn(2, 3, 2), 2)  # 3 channels in 2 groups (3*2 values would split)
    with pytest.raises(TypeError, match="num_groups"):
        fuseblock.group_norm(X3, 1.0)
    with pytest.raises(ValueError, match="weight"):
        fuseblock.group_norm(X3, 3, torch.ones(15))
    with pytest.raises(ValueError, match="x"):
        fuseblock.instance_norm(torch.randn(4, 3))
    with pytest.raises(ValueError, match="x"):
        fuseblock.instance_norm(torch.randn(4, 3, 1))  # one value per instance
    with pytest.raises(ValueError, match="eps"):
        fuseblock.instance_norm(X3, eps=-1.0)
    with pytest.raises(ValueError, match="num_features"):
        fuseblock.BatchNorm(0)
    with pytest.raises(ValueError, match="momentum"):
        fuseblock.BatchNorm(3, momentum=-0.1)
    with pytest.raises(ValueError, match="eps"):
        fuseblock.InstanceNorm(3, eps=-1.0)
    with pytest.raises(ValueError, match="x"):
        fuseblock.BatchNorm(4)(X3)  # 3 channels, not 4
    with pytest.raises(ValueError, match="x"):
        fuseblock.InstanceNorm(4)(X3)
