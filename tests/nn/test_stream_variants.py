"""The residual-stream shapes of ResidualStack and PreNormBlock (docs/stream.md): scaled
(alpha), parallel, branch dropout, post-norm, sandwich. Each fused stack equals its naive
twin (fused=False, the same parameters and state_dict) and an fp64 stack written out here
in plain torch ops, values and every gradient, on both paths; dropout by its statistics
in training and exactly nothing in eval; the combinations the ops do not fuse refused.
"""
import copy

import pytest
import torch
from helpers import MLP, AllLaunches, KeywordMixer, assert_close
from torch import nn

import fuseblock

D, SHAPE = 16, (2, 3, 16)
EPS = 1e-6



class Const(nn.Module):
    """A branch of ones times a learned scale: what dropout leaves of it is plain to read."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, h):
        return torch.ones_like(h) * self.scale


# name -> ResidualStack keywords (parallel: True builds one MLP per mixer)
SHAPES = {
    "scaled": dict(alpha=0.5),
    "parallel": dict(parallel=True),
    "parallel-scaled": dict(parallel=True, alpha=0.7),
    "post_norm": dict(post_norm=True),
    "post_norm-scaled": dict(post_norm=True, alpha=1.5),
    "sandwich": dict(sandwich=True),
    "sandwich-scaled-offset": dict(sandwich=True, alpha=0.5, weight_offset=1.0),
    "dropout-eval": dict(dropout=0.3, alpha=2.0),
}


def make_stack(shape, n=3, final_norm=True, kind="rms"):
    kw = dict(SHAPES[shape])
    if kw.pop("parallel", False):
        kw["parallel"] = [MLP(D) for _ in range(n)]
    stack = fuseblock.ResidualStack([nn.Linear(D, D) for _ in range(n)], D, eps=EPS, final_norm=final_norm,
                                    kind=kind, **kw)
    with torch.no_grad():  # norms away from their initial values, so a swapped weight shows
        for name, p in stack.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (0.0 if name.endswith("bias") or kw.get("weight_offset") else 1.0))
    return stack.eval()


def norm64(h, norm):
    """An RMS or layer norm of h in fp64 from a fuseblock Norm's parameters, written out."""
    h = h.double()
    q = h - h.mean(-1, keepdim=True) if norm.kind == "layer" else h
    out = q / torch.sqrt((q * q).mean(-1, keepdim=True) + EPS)
    if norm.weight is not None:
        out = out * (norm.weight_offset + norm.weight.double())
    return out if norm.bias is None else out + norm.bias.double()


def call64(module, t):
    """module(t) in fp64, its parameters the module's own through .double(), so the fp64
    graph reaches them."""
    params = {k: v.double() for k, v in module.named_parameters()}
    return torch.func.functional_call(copy.deepcopy(module).double(), params, (t,))


def stack64(stack, x):
    """The naive stack in fp64, from the issue's equations, on the stack's own parameters."""
    h = x.double()
    for b in stack.blocks:
        if b.post_norm:
            h = h + b.alpha * norm64(call64(b.mixer, h), b.branch_norm)
            continue
        n = norm64(h, b.norm)
        branch = call64(b.mixer, n)
        if b.parallel is not None:
            branch = branch + call64(b.parallel, n)
        if b.sandwich:
            branch = norm64(branch, b.branch_norm)
        h = h + b.alpha * branch
    return h if stack.norm_f is None else norm64(h, stack.norm_f)


def grads(out, cot, leaves):
    return torch.autograd.grad(out, leaves, cot, allow_unused=True)


@pytest.mark.kernel
@pytest.mark.parametrize("final_norm", [True, False], ids=["final", "nofinal"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_equals_naive_and_fp64(shape, final_norm):
    fused = make_stack(shape, final_norm=final_norm)
    naive = copy.deepcopy(fused)
    naive.fused = False
    assert list(fused.state_dict()) == list(naive.state_dict())
    x = torch.randn(SHAPE, requires_grad=True)
    cot = torch.randn(SHAPE)
    ref = stack64(fused, x)
    leaves = [x, *fused.parameters()]
    want = grads(ref, cot.double(), leaves)
    for name, stack in (("fused", fused), ("naive", naive)):
        out = stack(x)
        assert out.dtype == torch.float32
        assert_close(out, ref, torch.float32, f"{name} out")
        got = grads(out, cot, [x, *stack.parameters()])
        for (pname, _), g, w in zip([("x", x), *fused.named_parameters()], got, want, strict=True):
            assert (g is None) == (w is None), pname
            if g is not None:
                assert_close(g, w, torch.float32, f"{name} d{pname}")


@pytest.mark.kernel
@pytest.mark.parametrize("shape", ["plain", "sandwich", "post_norm"])
def test_per_channel_scales_fused_equals_naive_and_fp64(shape):
    # h <- a * h + b * branch with learned [d] gates (nGPT, Muse Spark), every block's: the
    # fused stack (each block's entry takes the previous output's scales, the stack's end
    # the last's), its naive twin and the fp64 stream, values and every gradient, a and b too
    a, b = nn.Parameter(torch.rand(D) + 0.5), nn.Parameter(torch.randn(D))
    fused = fuseblock.ResidualStack([nn.Linear(D, D) for _ in range(2)], D, eps=EPS, residual_scale=a,
                                    branch_scale=b, sandwich=shape == "sandwich", post_norm=shape == "post_norm")
    naive = copy.deepcopy(fused)
    naive.fused = False
    assert list(fused.state_dict()) == list(naive.state_dict())
    x = torch.randn(SHAPE, requires_grad=True)
    cot = torch.randn(SHAPE)
    h = x.double()
    for blk in fused.blocks:
        branch = call64(blk.mixer, h if blk.post_norm else norm64(h, blk.norm))
        if blk.branch_norm is not None:
            branch = norm64(branch, blk.branch_norm)
        h = a.double() * h + b.double() * branch
    ref = norm64(h, fused.norm_f)
    want = grads(ref, cot.double(), [x, *fused.parameters()])
    assert any(p is a for p in fused.parameters()) and any(p is b for p in fused.parameters())
    for name, stack in (("fused", fused), ("naive", naive)):
        out = stack(x)
        assert_close(out, ref, torch.float32, f"{name} out")
        got = grads(out, cot, [x, *stack.parameters()])
        for (pname, _), g, w in zip([("x", x), *fused.named_parameters()], got, want, strict=True):
            assert_close(g, w, torch.float32, f"{name} d{pname}")


def test_per_channel_scales_refused_by_name():
    with pytest.raises(ValueError, match="residual_scale must be a float or a \\(16,\\) float tensor"):
        fuseblock.PreNormBlock(nn.Identity(), D, residual_scale=torch.ones(D + 1))
    with pytest.raises(ValueError, match="alpha and branch_scale are one scale"):
        fuseblock.PreNormBlock(nn.Identity(), D, alpha=2.0, branch_scale=3.0)
    block = fuseblock.PreNormBlock(nn.Identity(), D, branch_scale=0.5)  # a float branch_scale is alpha
    assert block.alpha == 0.5 and block.branch_scale is None
    assert "residual_scale" in dict(fuseblock.PreNormBlock(nn.Identity(), D, residual_scale=torch.ones(D))
                                    .named_buffers())  # a plain tensor: a buffer, not learned


@pytest.mark.kernel
@pytest.mark.parametrize("shape", ["sandwich", "post_norm"])
def test_layer_norm_kind(shape):
    stack = make_stack(shape, n=2, kind="layer")
    x = torch.randn(SHAPE, requires_grad=True)
    assert_close(stack(x), stack64(stack, x), torch.float32, "out")


@pytest.mark.kernel
def test_bf16_stream_in_fp32():
    stack = fuseblock.ResidualStack([nn.Linear(D, D) for _ in range(2)], D, eps=EPS, sandwich=True, alpha=0.5,
                                    residual_dtype=torch.float32).to(torch.bfloat16).eval()
    for b in stack.blocks:
        b.norm.float(), b.branch_norm.float()
    x = torch.randn(SHAPE).to(torch.bfloat16)
    out = stack(x)
    assert out.dtype == torch.bfloat16
    naive = copy.deepcopy(stack)
    naive.fused = False
    assert_close(out, naive(x).float(), torch.bfloat16, "bf16 fused vs naive", cond=2.0)


def test_state_dict_keys_name_the_branch_norm_and_the_parallel_mixer():
    keys = lambda **kw: sorted(fuseblock.ResidualStack([nn.Linear(D, D, bias=False)], D, **kw).state_dict())  # noqa: E731
    assert keys(sandwich=True) == ["blocks.0.branch_norm.weight", "blocks.0.mixer.weight", "blocks.0.norm.weight",
                                   "norm_f.weight"]
    assert keys(post_norm=True) == ["blocks.0.branch_norm.weight", "blocks.0.mixer.weight", "norm_f.weight"]
    assert keys(parallel=[nn.Linear(D, D, bias=False)]) == [
        "blocks.0.mixer.weight", "blocks.0.norm.weight", "blocks.0.parallel.weight", "norm_f.weight"]
    assert keys(alpha=0.5, dropout=0.1) == keys()  # the scale and the dropout hold no state


def test_the_repr_shows_the_shape():
    text = repr(fuseblock.ResidualStack([nn.Identity()], D, sandwich=True, alpha=0.5))
    assert "PreNormBlock(\n      alpha=0.5, sandwich=True" in text and "(branch_norm): Norm(" in text
    assert "dropout=0.1" in repr(fuseblock.PreNormBlock(nn.Identity(), D, dropout=0.1))
    assert "post_norm=True" in repr(fuseblock.PreNormBlock(nn.Identity(), D, post_norm=True))


# ----------------------------------------------------------------- PreNormBlock on its own
@pytest.mark.kernel
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_block_chained_by_hand_is_its_naive_step(shape):
    """forward returns the branch before it is added; completing it by hand (the next
    block's add) gives naive(x)."""
    stack = make_stack(shape, n=2, final_norm=False)
    x = torch.randn(SHAPE)
    h, r = x, None
    for k, b in enumerate(stack.blocks):
        if b.post_norm:
            h, r = b(h, r)
            assert r is None
            continue
        prev = stack.blocks[k - 1].branch_norm if (b.sandwich and r is not None) else None
        h, r = b(h, r) if prev is None else b(h, r, branch_norm=prev)
    b = stack.blocks[-1]
    if b.post_norm:
        out = h
    elif b.sandwich:
        out = b.branch_norm.norm_add(h, r, alpha=b.alpha)
    else:
        out = r + b.alpha * (h[0] + h[1] if isinstance(h, tuple) else h)
    want = x
    for blk in stack.blocks:
        want = blk.naive(want)
    assert_close(out, want.double(), torch.float32, "chain")


def test_parallel_modules_get_their_own_keywords_and_extras_concatenate():
    block = fuseblock.PreNormBlock(KeywordMixer(D), D, parallel=KeywordMixer(D))
    x, r = torch.randn(SHAPE), torch.randn(SHAPE)
    (h, h1), _, e0, e1 = block(x, r, scale=2.0)
    assert torch.equal(e0, h.sum()) and torch.equal(e1, h1.sum())
    # an MLP beside a keyword mixer: the stack routes scale= to the mixer only
    stack = fuseblock.ResidualStack([KeywordMixer(D)], D, parallel=[MLP(D)], return_extras=True)
    for fused in (True, False):
        stack.fused = fused
        out, extras = stack(torch.randn(SHAPE), scale=0.5)
        assert len(extras) == 1 and len(extras[0]) == 1


# ----------------------------------------------------------------- dropout
@pytest.mark.kernel
@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "naive"])
def test_dropout_in_training_by_statistics_and_none_in_eval(fused, parallel):
    """Two blocks of Const (ones) branches, no final norm: out = x + drop(1) + drop(1)
    (four drops with the parallel ones). p = 0.5 keeps an element with probability 1/2,
    scaled to 2: each branch adds 0 or 2, the block's entry (add_norm's dropout) and the
    stack's end alike."""
    p, n = 0.5, 2
    stack = fuseblock.ResidualStack([Const() for _ in range(n)], D, dropout=p, final_norm=False, fused=fused,
                                    parallel=[Const() for _ in range(n)] if parallel else None)
    branches = n * (2 if parallel else 1)
    x = torch.zeros(64, 32, D)
    stack.eval()
    assert torch.equal(stack(x), torch.full_like(x, float(branches)))
    stack.train()
    out = stack(x)
    values, counts = torch.unique(out, return_counts=True)
    assert set(values.tolist()) <= {2.0 * k for k in range(branches + 1)}
    # the mean is the sum of the branches' (1 each), the variance that of a sum of
    # independent 0-or-2 draws (1 each): independent masks for every branch
    assert abs(out.mean().item() - branches) < 0.05
    assert abs(out.var().item() - branches) < 0.1 * branches
    # the same seed, the same masks
    torch.manual_seed(7)
    first = stack(x)
    torch.manual_seed(7)
    assert torch.equal(stack(x), first)


@pytest.mark.kernel
def test_dropout_gradient_is_zero_where_dropped():
    """out = x + drop(s1) + drop(s2), s1 dropped at block 2's entry (add_norm's dropout),
    s2 at the stack's end: d out.sum() / d s_k = 2 x (elements where branch k was kept),
    so the two gradients add to 2 x the kept count read off out, and x's is all ones."""
    p = 0.5
    stack = fuseblock.ResidualStack([Const(), Const()], D, dropout=p, final_norm=False).train()
    x = torch.zeros(8, 4, D, requires_grad=True)
    out = stack(x)
    ds = torch.autograd.grad(out.sum(), [x, stack.blocks[0].mixer.scale, stack.blocks[1].mixer.scale])
    assert torch.equal(ds[0], torch.ones_like(x))  # the residual is never dropped
    kept = out / 2  # 0, 1 or 2 kept branches per element
    assert ds[1].item() + ds[2].item() == pytest.approx(2 * kept.sum().item())
    assert 0 < ds[1].item() < 2 * x.numel() and 0 < ds[2].item() < 2 * x.numel()


# ----------------------------------------------------------------- refusals
@pytest.mark.parametrize("kw,error,needle", [
    (dict(sandwich=True, post_norm=True), ValueError, "sandwich with post_norm"),
    (dict(sandwich=True, dropout=0.1), ValueError, "sandwich with dropout"),
    (dict(post_norm=True, dropout=0.1), ValueError, "post_norm with dropout"),
    (dict(sandwich=True, parallel=[nn.Identity()]), ValueError, "sandwich with parallel"),
    (dict(post_norm=True, parallel=[nn.Identity()]), ValueError, "post_norm with parallel"),
    (dict(post_norm=True, residual_dtype=torch.float32), ValueError, "post_norm with residual_dtype"),
    (dict(alpha=float("inf")), ValueError, "alpha"),
    (dict(alpha="1"), TypeError, "alpha"),
    (dict(dropout=1.0), ValueError, "dropout"),
    (dict(dropout=-0.1), ValueError, "dropout"),
    (dict(dropout=True), ValueError, "dropout"),
    (dict(sandwich=1), TypeError, "sandwich"),
    (dict(parallel=[nn.Identity(), nn.Identity()]), ValueError, "parallel must hold one"),
    (dict(parallel=[3]), TypeError, r"parallel\[0\]"),
    (dict(parallel=nn.Linear(D, D)), TypeError, "parallel must be an iterable"),
])
def test_bad_options(kw, error, needle):
    with pytest.raises(error, match=needle):
        fuseblock.ResidualStack([nn.Identity()], D, **kw)


class FusesPrenorm(nn.Module):
    fuses_prenorm = True

    def forward(self, hidden, residual, *, prenorm):
        return prenorm.add(hidden, residual)


def test_misuse_at_call_time():
    x = torch.randn(SHAPE)
    with pytest.raises(ValueError, match="fuses_prenorm"):
        fuseblock.PreNormBlock(FusesPrenorm(), D, alpha=0.5)(x)
    with pytest.raises(ValueError, match="branch_norm=previous_block.branch_norm"):
        fuseblock.PreNormBlock(nn.Identity(), D, sandwich=True)(x, x)
    with pytest.raises(ValueError, match="post_norm block takes the whole stream"):
        fuseblock.PreNormBlock(nn.Identity(), D, post_norm=True)(x, x)
    with pytest.raises(ValueError, match="parallel\\[0\\] \\(Linear\\) maps last dim 16 to 4"):
        fuseblock.ResidualStack([nn.Identity()], D, parallel=[nn.Linear(D, 4)])(x)
    with pytest.raises(ValueError, match="mixer \\(Linear\\) maps shape"):
        fuseblock.ResidualStack([nn.Linear(D, 4)], D, post_norm=True)(x)


# ----------------------------------------------------------------- launches
@pytest.mark.kernel
@pytest.mark.kernel_only("counts Triton launches")
@pytest.mark.parametrize("shape", ["scaled", "parallel", "post_norm", "sandwich", "dropout-train"])
def test_one_launch_per_sublayer_and_one_for_the_final_norm(shape):
    """3 sublayers of Identity mixers (they launch nothing) and a final norm: 4 Triton
    launches forward and 4 backward (6 rows: no partial-row reduction), and forward no
    other op but dropout's seed draws."""
    n = 3
    kw = dict(dropout=0.1) if shape == "dropout-train" else dict(SHAPES[shape])
    if kw.pop("parallel", False):
        kw["parallel"] = [nn.Identity() for _ in range(n)]
    stack = fuseblock.ResidualStack([nn.Identity() for _ in range(n)], D, **kw).train()
    x = torch.randn(SHAPE, requires_grad=True)
    with AllLaunches() as fwd:
        out = stack(x)
    with AllLaunches() as bwd:
        out.sum().backward()
    assert fwd.kernels == n + 1 and bwd.kernels == n + 1
    assert [op for op in fwd.ops if op != "randint"] == []


# ----------------------------------------------------------------- Norm's branch methods
@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_methods_take_each_norms_own_settings(kind):
    """Norm.norm_add_norm: the branch norm keeps its eps (None: torch's for x, not the
    other norm's eps) and weight_offset, the other its own; values and gradients vs fp64."""
    branch = fuseblock.Norm(D, kind=kind, eps=None, weight_offset=1.0)
    after = fuseblock.Norm(D, kind=kind, eps=1e-2)
    with torch.no_grad():
        for p in [*branch.parameters(), *after.parameters()]:
            p.normal_()
    x = (torch.randn(5, D) * 1e-2).requires_grad_(True)  # small rows: eps=1e-2 and fp32's eps differ a lot
    r = torch.randn(5, D).requires_grad_(True)
    leaves = [x, r, *branch.parameters(), *after.parameters()]

    def n64(h, norm, eps):
        q = h - h.mean(-1, keepdim=True) if kind == "layer" else h
        y = q / torch.sqrt((q * q).mean(-1, keepdim=True) + eps) * (norm.weight_offset + norm.weight.double())
        return y if norm.bias is None else y + norm.bias.double()

    beps = 1e-5 if kind == "layer" else torch.finfo(torch.float32).eps
    r64 = r.double() + 0.5 * n64(x.double(), branch, beps)
    out64 = n64(r64, after, 1e-2)
    out, new_r = branch.norm_add_norm(x, r, after, alpha=0.5)
    assert_close(new_r, r64, torch.float32, "new_residual")
    assert_close(out, out64, torch.float32, "out")
    cot = torch.randn(5, D)
    for g, w in zip(grads(out, cot, leaves), grads(out64, cot.double(), leaves), strict=True):
        assert_close(g, w, torch.float32, "grad")
    assert_close(branch.norm_add(x, r, alpha=0.5), r64, torch.float32, "norm_add")


@pytest.mark.parametrize("make,needle", [
    (lambda: fuseblock.Norm(D).norm_add_norm(torch.randn(2, D), torch.randn(2, D), fuseblock.Norm(D, kind="layer")),
     "one kind"),
    (lambda: fuseblock.Norm(D, c=2.0).norm_add(torch.randn(2, D), torch.randn(2, D)), "c or num_groups"),
    (lambda: fuseblock.Norm(D).norm_add_norm(torch.randn(2, D), torch.randn(2, D), fuseblock.Norm(D, num_groups=2)),
     "c or num_groups"),
])
def test_norm_methods_refuse_what_the_ops_do_not_take(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


# ----------------------------------------------------------------- torch.compile
def _compiles_whole(shape):
    torch._dynamo.reset()
    stack = make_stack(shape, n=2)
    x = torch.randn(SHAPE)
    assert_close(torch.compile(stack, fullgraph=True)(x), stack(x).double(), torch.float32, "compiled")


@pytest.mark.kernel
@pytest.mark.parametrize("shape", ["scaled", "parallel-scaled", "dropout-eval"])
def test_compiles_with_no_graph_break(shape):
    _compiles_whole(shape)


@pytest.mark.torch_only("norm_add's and norm_add_norm's kernel path under compile: tests/ops/test_norm_add.py")
@pytest.mark.parametrize("shape", ["sandwich", "post_norm"])
def test_compiles_with_no_graph_break_norm_add_shapes(shape):
    _compiles_whole(shape)


@pytest.mark.torch_only("add_norm's plain lane is the CPU torch path's")
def test_a_plain_stack_keeps_add_norms_plain_lane(monkeypatch):
    """The shapes' keywords are left out of a plain call, so add_norm's host-time fast lane
    (which tests the branch defaults by identity) still serves the plain stack and block."""
    import fuseblock.ops.norm as ops_norm

    calls = []
    real = ops_norm._plain_call
    monkeypatch.setattr(ops_norm, "_plain_call", lambda *a: calls.append(1) or real(*a))
    fuseblock.ResidualStack([nn.Identity() for _ in range(3)], D)(torch.randn(SHAPE))
    assert len(calls) == 4
    fuseblock.ResidualStack([nn.Identity() for _ in range(3)], D, dropout=0.1).eval()(torch.randn(SHAPE))
    assert len(calls) == 8  # dropout in eval is the plain call too


# ----------------------------------------------------------------- alpha, dropout set on a built stack
@pytest.mark.kernel
@pytest.mark.parametrize("shape", ["scaled", "parallel", "sandwich"])
def test_alpha_set_on_a_built_stack_reaches_every_block(shape):
    """`stack.alpha = 2.0` is every block's alpha: the fused form (which applies a block's
    at the next block's entry and the stack's at its end) equals the naive form and the fp64
    stack built with alpha=2.0 (the fused form's last join alone took it: 1.72 apart)."""
    fused = make_stack(shape)
    fused.alpha = 2.0
    assert fused.alpha == 2.0 and all(b.alpha == 2.0 for b in fused.blocks)
    naive = copy.deepcopy(fused)
    naive.fused = False
    x = torch.randn(SHAPE)
    ref = stack64(fused, x)
    assert_close(fused(x), ref, torch.float32, "fused")
    assert_close(naive(x), ref, torch.float32, "naive")


@pytest.mark.kernel
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "naive"])
def test_dropout_set_on_a_built_stack_reaches_every_block(fused):
    """`stack.dropout = 0.0` turns dropout off at every join in training (it stayed on at
    the blocks' entries), and `stack.dropout = 0.5` on at every one: out = x + one 0-or-2
    draw per Const branch, as for a stack built with it."""
    n = 2
    stack = fuseblock.ResidualStack([Const() for _ in range(n)], D, dropout=0.3, final_norm=False,
                                    fused=fused).train()
    x = torch.zeros(64, 32, D)
    stack.dropout = 0.0
    assert stack.dropout == 0.0 and all(b.dropout == 0.0 for b in stack.blocks)
    assert torch.equal(stack(x), torch.full_like(x, float(n)))
    stack.dropout = 0.5
    out = stack(x)
    assert set(torch.unique(out).tolist()) <= {0.0, 2.0, 4.0}
    assert abs(out.mean().item() - n) < 0.05 and abs(out.var().item() - n) < 0.1 * n


@pytest.mark.parametrize("kw,name,value,error", [
    (dict(), "alpha", float("nan"), ValueError),
    (dict(), "alpha", "2", TypeError),
    (dict(), "dropout", 1.0, ValueError),
    (dict(sandwich=True), "dropout", 0.1, ValueError),
    (dict(post_norm=True), "dropout", 0.1, ValueError),
])
def test_alpha_and_dropout_set_on_a_built_stack_are_checked_as_the_constructors(kw, name, value, error):
    stack = fuseblock.ResidualStack([nn.Identity(), nn.Identity()], D, **kw)
    before = [getattr(b, name) for b in stack.blocks]
    with pytest.raises(error, match=name):
        setattr(stack, name, value)
    assert [getattr(b, name) for b in stack.blocks] == before and getattr(stack, name) == before[0]
