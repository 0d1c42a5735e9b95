"""embed_norm (docs/family.md): the L1, L2 and max embedding norms against F.normalize in
float64, values and gradients, the "max" norm also against its fp64 formula; and the one
compiled graph of embed_norm after batch_norm."""
import pytest
import torch
import torch.nn.functional as F
from family_helpers import HALF, WIDE, P, check_grads, loops
from helpers import KERNEL_PATH, assert_close
from ref64 import leaf64

import fuseblock
from fuseblock.ops.embed_norm import embed_norm_op
from fuseblock.ops.norm import uses_triton


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
