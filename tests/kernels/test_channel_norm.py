"""The channel-norm kernels (fuseblock.kernels.channel_norm: one program per normalized
set, the affine per channel) on the kernel path, the torch path's ops elsewhere: values,
gradients and running buffers of batch, group and instance norm against torch's
functions and an fp64 formula of their own; their bad input."""
import pytest
import torch
import torch.nn.functional as F
from family_helpers import HALF
from helpers import KERNEL_PATH, assert_close
from ref64 import leaf64

import fuseblock
from fuseblock.ops.channel_norm import channel_norm_op

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
SETS = [(op, s) for op in CHANNEL for s in CHANNEL_SHAPES[op]]
DTYPES = [torch.float32] + HALF
# The torch path: every set shape in every dtype, with and without the affine. The kernel
# path: per set shape both kernels' affine modes (HAS_W, HAS_B constexprs), the dtypes
# (which change only the loads' and stores' casts) in turn, so each op sees all three.
MATCH_CASES = [(op, s, DTYPES[(i + j) % 3], affine) for i, (op, s) in enumerate(SETS)
               for j, affine in enumerate((True, False))] if KERNEL_PATH \
    else [(op, s, d, affine) for op, s in SETS for d in DTYPES for affine in (True, False)]


@pytest.mark.kernel
@pytest.mark.parametrize("op,shape,dtype,affine", MATCH_CASES,
                         ids=lambda v: ("affine" if v else "plain") if isinstance(v, bool) else str(v))
def test_channel_norms_match_torch_and_fp64(op, shape, dtype, affine):
    # (N, C) with L = 1, L = 5 and L = 21 (not powers of two), (N, C, H, W)
    run_channel(op, (torch.randn(shape) * 2 + 1).to(dtype), affine)


@pytest.mark.kernel
@pytest.mark.usefixtures("small_channel_blocks")
@pytest.mark.parametrize("op,shape,dtype", [
    ("batch", (5, 4, 37), torch.float32),  # sets of 185: 5 rows of one, 3 ragged column blocks
    ("batch", (40, 4), torch.bfloat16),  # L = 1: 40 rows in blocks of 16, the last ragged
    ("batch", (3, 4, 2, 3), torch.bfloat16),  # L = 6 in a block of 8: 3 rows in blocks of 2
    ("group", (2, 4, 37), torch.bfloat16),  # 2-channel groups: a block per row and 3 per L
    ("instance", (2, 4, 37), torch.float32),  # one row: 3 ragged column blocks
], ids=str)
def test_channel_norms_loop_over_blocks_of_long_sets(op, shape, dtype):
    # blocks of 16: long sets loop over rows (batch norm's samples, group norm's channels)
    # and over ragged column blocks; the parameters fp32 under bf16 inputs. The fp32/bf16
    # casts are the only difference between dtypes: each case takes one.
    run_channel(op, (torch.randn(shape) * 3 - 2).to(dtype), param_dtype=torch.float32)


@pytest.mark.kernel
@pytest.mark.parametrize("op", CHANNEL)
@pytest.mark.parametrize("how", ["transposed", "sliced", "permuted"])
def test_channel_norms_of_non_contiguous_inputs(op, how):
    # transposed: (C, N, L) storage, viewed (N, C, L); sliced: every other value of L;
    # permuted: (N, H, W, C) storage, whose trailing dims cannot be viewed as one L
    base = torch.randn(2, 4, 10)
    x = {"transposed": lambda: base.transpose(0, 1), "sliced": lambda: base[:, :, ::2],
         "permuted": lambda: base.view(2, 5, 2, 4).permute(0, 3, 1, 2)}[how]()
    assert not x.is_contiguous()
    torch.manual_seed(0)
    y = run_channel(op, x)
    torch.manual_seed(0)
    torch.testing.assert_close(y, run_channel(op, x.contiguous()), rtol=1e-6, atol=1e-6)


# The kernel path: each op in one block and in small blocks, the dtypes (casts only) in turn
CONSTANT_CASES = [(op, DTYPES[(i + j) % 3], blocks) for i, op in enumerate(CHANNEL)
                  for j, blocks in enumerate(("one_block", "small_blocks"))] if KERNEL_PATH \
    else [(op, d, blocks) for op in CHANNEL for d in DTYPES for blocks in ("one_block", "small_blocks")]


@pytest.mark.kernel
@pytest.mark.parametrize("op,dtype,blocks", CONSTANT_CASES, ids=str)
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
@pytest.mark.parametrize("momentum,dtype", [(0.1, torch.bfloat16), (None, torch.float32)] if KERNEL_PATH else
                         [(m, d) for m in (0.1, None) for d in (torch.float32, torch.bfloat16)], ids=str)
def test_batch_norm_module_running_stats_over_long_sets(momentum, dtype):
    # the kernel path: each momentum (the module's, host side) once, in one of the two dtypes
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
    with pytest.raises(ValueError, match=r"x must be \(N, 3\) or \(N, 3, L\)"):  # nn.BatchNorm1d's shapes
        fuseblock.BatchNorm(3)(torch.randn(2, 3, 2, 2))
    assert fuseblock.batch_norm(torch.randn(2, 3, 2, 2), None, None, training=True).shape == (2, 3, 2, 2)
