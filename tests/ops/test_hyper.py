"""The hyper-connection (mHC) boundary ops, `hc_add_norm`, `hc_norm`, `hc_head`, on both paths:
values and every gradient against an fp64 reference written here from the formulas
(docs/stream.md), gradcheck, torch.compile, bad input, and the n = 1 case against add_norm."""
import math

import pytest
import torch
from helpers import DEVICE, KERNEL_PATH, assert_close

import fuseblock

EPS, HC_EPS = 1e-6, 1e-6


# ---------------------------------------------------------------- the fp64 reference, from the formulas
def _sinkhorn64(logits, iters, hc_eps):
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    c = e / e.sum(-1, keepdim=True) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    return c


def boundary64(H, f, post, comb, fn, base, scale, weight, *, iters, hc_eps=HC_EPS, eps=EPS, post_mult=2.0,
               post_eps=0.0, head=False, stored=None):
    """(y, H', post', comb') in fp64. stored: the streams' dtype, which H' and the collapse
    are rounded to (straight-through, as the op stores them)."""
    def rounded(t):
        return t if stored is None else t + (t.to(stored).double() - t).detach()

    H = H.double()
    n = H.shape[-2]
    if f is not None:
        mixed = H if comb is None else torch.einsum("...jk,...jd->...kd", comb.double(), H)
        H = rounded(post.double()[..., None] * f.double()[..., None, :] + mixed)
    if fn is None:
        pre = torch.full(H.shape[:-1], 1.0 / n, dtype=torch.float64)
        nxt = None
    else:
        x = H.flatten(-2)
        mix = (x @ fn.double().T) / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        a = mix * torch.repeat_interleave(scale.double(), torch.tensor([n, n, n * n][:len(scale)])) + base.double()
        pre = torch.sigmoid(a[..., :n]) + hc_eps
        nxt = None
        if not head:
            p2 = post_mult * torch.sigmoid(a[..., n:2 * n]) + post_eps
            c2 = _sinkhorn64(a[..., 2 * n:].unflatten(-1, (n, n)), iters, hc_eps) if len(scale) == 3 else None
            nxt = (p2, c2)
    z = rounded((pre[..., None] * H).sum(-2))
    y = z / torch.sqrt((z * z).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    return y, H, nxt


# ---------------------------------------------------------------- inputs
def _inputs(n, d, *, lead=(2, 3), dtype=torch.float32, comb=True, comb_out=True, head=False, update=True):
    m = n if head else (2 * n + n * n if comb_out else 2 * n)
    H = torch.randn(*lead, n, d, dtype=dtype)
    f = torch.randn(*lead, d, dtype=dtype) if update else None
    post = (2 * torch.rand(*lead, n)) if update else None
    c = None
    if update and comb:
        c = torch.softmax(torch.randn(*lead, n, n), -1)
        c = c / c.sum(-2, keepdim=True)
    fn = torch.randn(m, n * d) / math.sqrt(n * d)
    base = torch.randn(m) * 0.5
    scale = 1 + 0.5 * torch.rand(1 if head else (3 if comb_out else 2))
    weight = 1 + 0.2 * torch.randn(d)
    return dict(H=H, f=f, post=post, comb=c, fn=fn, base=base, scale=scale, weight=weight)


def _leaves(t):
    return {k: v.requires_grad_(True) for k, v in t.items() if v is not None}


def _check(got, ref, leaves, dtype, *, cond=1.0):
    """Values and the gradients of every leaf: a random cotangent on each output."""
    outs = [o for o in got if o is not None]
    refs = [r for r in ref if r is not None]
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert_close(o, r, dtype, f"output {i}", cond=cond)  # post', comb' too: they see the stored H'
    cots = [torch.randn(o.shape, dtype=torch.float64) for o in outs]
    loss = sum((o.double() * c).sum() for o, c in zip(outs, cots, strict=True))
    ref_loss = sum((r * c).sum() for r, c in zip(refs, cots, strict=True))
    names = list(leaves)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    ref_grads = torch.autograd.grad(ref_loss, list(leaves.values()))
    for name, g, rg in zip(names, grads, ref_grads, strict=True):
        assert g.dtype == leaves[name].dtype, name
        assert_close(g, rg, dtype, f"d{name}", cond=cond)


def _boundary_against_fp64(t, iters, **kw):
    """hc_add_norm on inputs t (fp32), values and every gradient against boundary64; kw:
    hc_eps, eps, to both."""
    leaves = _leaves(t)
    got = fuseblock.hc_add_norm(t["H"], t["f"], t["post"], t["comb"], t["fn"], t["base"], t["scale"], t["weight"],
                                iters=iters, **kw)
    ref = boundary64(t["H"], t["f"], t["post"], t["comb"], t["fn"], t["base"], t["scale"], t["weight"], iters=iters,
                     **kw)
    _check(got, (ref[0], ref[1], *ref[2]), leaves, torch.float32)


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.kernel
@pytest.mark.parametrize("n,iters,comb,dtype", [(1, 1, True, F32), (1, 20, False, BF16), (2, 20, True, BF16),
                                                (4, 1, False, F32), (4, 20, True, F32), (4, 20, True, BF16),
                                                (8, 1, True, F32), (8, 20, False, BF16)])
def test_hc_add_norm_against_fp64(n, iters, comb, dtype):
    t = _inputs(n, 24, dtype=dtype, comb=comb, comb_out=comb)
    leaves = _leaves(t)
    got = fuseblock.hc_add_norm(t["H"], t["f"], t["post"], t["comb"], t["fn"], t["base"], t["scale"], t["weight"],
                                iters=iters, hc_eps=HC_EPS, eps=EPS)
    y, H2, nxt = boundary64(t["H"], t["f"], t["post"], t["comb"], t["fn"], t["base"], t["scale"], t["weight"],
                            iters=iters, stored=dtype)
    assert got[0].dtype == got[1].dtype == dtype and got[2].dtype == torch.float32
    assert (got[3] is None) == (not comb)
    # bf16: the stored H' and collapse carry one rounding each, and the coefficients see
    # the rounded H' (the reference rounds the same values straight-through)
    _check(got, (y, H2, *nxt), leaves, dtype, cond=4.0 if dtype == torch.bfloat16 else 1.0)


@pytest.mark.kernel
@pytest.mark.parametrize("comb", [True, False])
def test_hc_add_norm_wide_rows(comb):
    """Rows of several column chunks in every pass of the kernels (d = 300: 5 chunks of 64 in the
    projection pass, 3 of 128 in the collapse passes)."""
    _boundary_against_fp64(_inputs(4, 300, lead=(3,), comb=comb, comb_out=comb), iters=5)


@pytest.mark.kernel
@pytest.mark.parametrize("n", [1, 4])
def test_hc_norm_first_boundary(n):
    t = _inputs(n, 32, update=False)
    leaves = _leaves(t)
    got = fuseblock.hc_norm(t["H"], t["fn"], t["base"], t["scale"], t["weight"], iters=20)
    y, _, nxt = boundary64(t["H"], None, None, None, t["fn"], t["base"], t["scale"], t["weight"], iters=20)
    _check(got, (y, *nxt), leaves, torch.float32)


@pytest.mark.kernel
@pytest.mark.parametrize("mean,update", [(False, False), (False, True), (True, False)])
def test_hc_head(mean, update):
    t = _inputs(4, 32, head=True, update=update)
    if mean:
        t["fn"] = t["base"] = t["scale"] = None
    leaves = _leaves(t)
    y, new = fuseblock.hc_head(t["H"], t["fn"], t["base"], t["scale"], t["weight"], branch=t["f"], post=t["post"],
                               comb=t["comb"])
    ry, rH, _ = boundary64(t["H"], t["f"], t["post"], t["comb"], t["fn"], t["base"], t["scale"], t["weight"],
                           iters=1, head=True)
    assert (new is t["H"]) == (not update)
    _check((y, new) if update else (y,), (ry, rH) if update else (ry,), leaves, torch.float32)


@pytest.mark.kernel
def test_sixteen_streams():
    _boundary_against_fp64(_inputs(16, 8, lead=(2,)), iters=2)


@pytest.mark.kernel
def test_programs_walking_several_token_blocks(monkeypatch):
    """The backward's persistent programs each take several blocks of 16 tokens (one SM:
    2 programs for 3 blocks, the last 8 tokens short), rewriting their Sinkhorn scratch per
    block, and its fn^T dv dot takes fn's m = 80 rows (n = 8) 16 at a time."""
    import fuseblock.kernels.hyper as K

    monkeypatch.setattr(K, "num_sms", lambda device: 1)
    _boundary_against_fp64(_inputs(8, 24, lead=(40,)), iters=4)


@pytest.mark.kernel
@pytest.mark.parametrize("update,n,hc_eps", [(True, 3, HC_EPS), (True, 5, 0.0), (False, 6, HC_EPS), (False, 3, 0.0)])
def test_stream_counts_not_a_power_of_two(update, n, hc_eps):
    """n = 3, 5, 6 pad the kernels' [NP, NP] comb blocks to 4 or 8: 20 Sinkhorn passes, values
    and gradients against fp64 (the padded lanes divided by 0 + hc_eps in every backward pass
    overflowed: every gradient NaN; at hc_eps = 0 the forward's comb was 0 / 0 = NaN)."""
    t = _inputs(n, 8, lead=(3,), update=update)
    if update:
        _boundary_against_fp64(t, 20, hc_eps=hc_eps)
        return
    leaves = _leaves(t)
    got = fuseblock.hc_norm(t["H"], t["fn"], t["base"], t["scale"], t["weight"], iters=20, hc_eps=hc_eps)
    y, _, nxt = boundary64(t["H"], None, None, None, t["fn"], t["base"], t["scale"], t["weight"], iters=20,
                           hc_eps=hc_eps)
    _check(got, (y, *nxt), leaves, torch.float32)


@pytest.mark.kernel
def test_eps_zero_with_a_partial_token_block():
    """eps = 0 and 5 tokens: the kernels' token block of 16 has 11 masked tokens, whose
    rsqrt(0 + 0) = inf made the weight gradient 0 * inf = NaN."""
    _boundary_against_fp64(_inputs(4, 8, lead=(5,)), 3, eps=0.0)


@pytest.mark.kernel
def test_permuted_inputs():
    """A sequence-first branch, post and comb ((T, B, ...) views of (B, T, ...) tensors) and
    fn = W.t(): their gradients come back right (the kernels write them contiguous; an
    empty_like of a permuted input kept its strides: df off by 100%, dfn by 0.68)."""
    t = _inputs(4, 8, lead=(3, 2))
    for k in ("f", "post", "comb"):
        t[k] = t[k].transpose(0, 1).contiguous().transpose(0, 1)
        assert not t[k].is_contiguous()
    t["fn"] = t["fn"].t().contiguous().t()
    _boundary_against_fp64(t, 3)


@pytest.mark.kernel
@pytest.mark.kernel_only("the kernels' token splits of the parameter sums")
def test_parameter_sums_split_over_tokens(monkeypatch):
    """_bwd_params splits its token sums (dfn, dbase, dscale) so that they fill the GPU, the
    last split to arrive adding the partial sums up: here 3 splits of 40 tokens (16, 16, 8),
    with comb (n = 8, m = 80) and without (n = 2, m = 4)."""
    import fuseblock.kernels.hyper as K

    grids = []

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid[0])
            return original[grid]

    original = K._bwd_params
    monkeypatch.setattr(K, "MIN_SPLIT_BLOCKS", 1)
    monkeypatch.setattr(K, "_bwd_params", Spy())
    _boundary_against_fp64(_inputs(8, 24, lead=(40,)), 2)
    _boundary_against_fp64(_inputs(2, 8, lead=(40,), comb=False, comb_out=False), 2)
    # dfn's 3 and 1 column chunks, each over 3 splits; dw's one program; dbase's 3
    assert grids == [3 * 3 + 1 + 3, 1 * 3 + 1 + 3]


@pytest.mark.kernel
@pytest.mark.parametrize("form", ["fused", "deepseek_v4", "hy_v4", "glm5_next"])
def test_y_dtype_follows_the_form_on_both_paths(form):
    """bf16 streams, an fp32 weight: y is bf16 where the form's norm rounds w h once (fuseblock's,
    DeepSeek-V4's), fp32 where it multiplies the weight after rounding h (HY-V4's and
    GLM-5-next's w * h.to(dtype), Llama's), as their modeling code returns; the kernel path
    gave bf16 for every form. Values and gradients against fp64 (hc_norm: no update, whose
    order also follows the form)."""
    comb = form != "hy_v4"
    t = _inputs(4, 16, lead=(3,), dtype=BF16, update=False, comb_out=comb)
    kw = dict(post_mult=1.5, post_eps=HC_EPS) if form == "hy_v4" else {}
    leaves = _leaves(t)
    got = fuseblock.hc_norm(t["H"], t["fn"], t["base"], t["scale"], t["weight"], iters=4, form=form, **kw)
    assert got[0].dtype == (BF16 if form in ("fused", "deepseek_v4") else F32)
    y, _, nxt = boundary64(t["H"], None, None, None, t["fn"], t["base"], t["scale"], t["weight"], iters=4,
                           stored=BF16, **kw)
    _check(got, (y, *nxt), leaves, BF16, cond=4.0)


def test_gradcheck_fp64_torch_path():
    t = {k: (v.double() if v is not None else None) for k, v in _inputs(2, 3, lead=(2,)).items()}
    leaves = _leaves(t)

    def fn(H, f, post, comb, fn, base, scale, weight):
        return fuseblock.hc_add_norm(H, f, post, comb, fn, base, scale, weight, iters=4, hc_eps=1e-3, eps=1e-5)

    assert torch.autograd.gradcheck(fn, tuple(leaves.values()), fast_mode=True)


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_stream_is_add_norm(dtype):
    """n = 1, comb = [[1]], post = 1: the new stream is add_norm's new residual x + r, and y
    is the norm of pre * (x + r). fn = 0 and base = 0 make pre = sigmoid(0) + hc_eps = 0.75
    exactly, so the test can form pre * (x + r) as the op does."""
    d = 40
    r, x = torch.randn(5, 1, d, dtype=dtype), torch.randn(5, d, dtype=dtype)
    w = 1 + 0.1 * torch.randn(d)
    fn, base, scale = torch.zeros(3, d), torch.zeros(3), torch.ones(3)
    y, H2, _, _ = fuseblock.hc_add_norm(r, x, torch.ones(5, 1), torch.ones(5, 1, 1), fn, base, scale, w, iters=1,
                                        hc_eps=0.25, eps=EPS)
    out, new_res = fuseblock.add_norm(x, r[:, 0], w, eps=EPS)
    assert torch.equal(H2[:, 0], new_res)
    want = fuseblock.norm((0.75 * new_res.float()).to(dtype), w, eps=EPS)
    if not KERNEL_PATH or (DEVICE == "cpu" and dtype == torch.float32):
        assert torch.equal(y, want)  # the interpreter's row sums agree; a GPU's two kernels need not
    else:
        assert_close(y, want.double(), dtype, "y")


@pytest.mark.kernel
def test_compile_fullgraph_no_break():
    t = _inputs(4, 16, lead=(2, 3))
    leaves = _leaves(t)

    def step(H, f, post, comb, fn, base, scale, weight):
        y, H2, p, c = fuseblock.hc_add_norm(H, f, post, comb, fn, base, scale, weight, iters=3)
        return y.sum() + H2.square().sum() + p.sum() + (c * c).sum()

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(*leaves.values())
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    graph = str(explained.graphs[0].graph)
    assert ("fuseblock.hc_fwd" in graph) == KERNEL_PATH
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(*leaves.values()), list(leaves.values()))
    want = torch.autograd.grad(step(*leaves.values()), list(leaves.values()))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _bad_call(**change):
    t = _inputs(4, 8)
    args = dict(streams=t["H"], branch=t["f"], post=t["post"], comb=t["comb"], fn=t["fn"], base=t["base"],
                scale=t["scale"], weight=t["weight"])
    kw = dict(iters=2, hc_eps=HC_EPS, eps=EPS)
    for k, v in change.items():
        (kw if k in kw or k in ("kind", "form") else args)[k] = v
    return fuseblock.hc_add_norm(*args.values(), **kw)


@pytest.mark.parametrize("change,match", [
    (dict(fn=torch.randn(24, 33)), "fn must have shape"),
    (dict(fn=torch.randn(25, 32)), "fn must have shape"),
    (dict(iters=0), "iters must be >= 1"),
    (dict(eps=math.nan), "eps must be finite"),
    (dict(hc_eps=math.inf), "hc_eps must be finite"),
    (dict(streams=torch.randn(8)), "streams must have shape"),
    (dict(streams=torch.randn(2, 3, 17, 8)), "stream count"),
    (dict(branch=torch.randn(2, 3, 9)), "branch must have shape"),
    (dict(post=torch.randn(2, 3, 5)), "post must have shape"),
    (dict(comb=torch.randn(2, 3, 4, 3)), "comb must have shape"),
    (dict(base=torch.randn(23)), "base must have shape"),
    (dict(scale=torch.randn(2)), "scale must have shape"),
    (dict(weight=torch.randn(9)), "weight must have shape"),
    (dict(kind="layer"), "kind must be 'rms'"),
    (dict(form="llama"), "form must be one of"),
])
def test_bad_input_names_the_argument(change, match):
    with pytest.raises(ValueError, match=match):
        _bad_call(**change)


def test_bad_types_and_head_arguments():
    with pytest.raises(TypeError, match="iters must be an int"):
        _bad_call(iters=2.0)
    with pytest.raises(TypeError, match="fn must be a torch.Tensor"):
        _bad_call(fn=[1.0])
    t = _inputs(4, 8, head=True, update=False)
    with pytest.raises(ValueError, match="base and scale apply only with fn"):
        fuseblock.hc_head(t["H"], None, t["base"], None, t["weight"])
    with pytest.raises(ValueError, match="post and comb apply only with a branch"):
        fuseblock.hc_head(t["H"], t["fn"], t["base"], t["scale"], t["weight"], post=torch.ones(2, 3, 4))


# ---------------------------------------------------------------- the families' modeling code, bit for bit
def _family(name):
    """(module, config) of a family's HyperConnection, HyperHead and RMSNorm classes, or skip."""
    tf = pytest.importorskip("transformers")
    mods = {"deepseek_v4": ("deepseek_v4", "DeepseekV4"), "hy_v4": ("hy_v4", "HYV4"),
            "glm5_next": ("glm5_next", "Glm5NextText")}
    path, prefix = mods[name]
    try:
        module = __import__(f"transformers.models.{path}.modeling_{path}", fromlist=["x"])
    except ImportError:
        pytest.skip(f"transformers {tf.__version__} has no {path}")
    return module, prefix


@pytest.mark.torch_only("the torch path's forms reproduce the modeling code's op order; the kernels their own")
@pytest.mark.parametrize("family", ["deepseek_v4", "hy_v4", "glm5_next"])
def test_forms_equal_the_modeling_code_bitwise(family):
    """One decoder-layer boundary and the head, in fp32: the modeling code's update, its
    HyperConnection and its RMSNorm against hc_add_norm(form=family); values and gradients equal."""
    from types import SimpleNamespace

    module, prefix = _family(family)
    n, d = 4, 32
    cfg = SimpleNamespace(hc_mult=n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=d,
                          hc_magnitude=1.5)
    hc = getattr(module, f"{prefix}HyperConnection")(cfg)
    norm = getattr(module, f"{prefix}RMSNorm")(d, eps=cfg.rms_norm_eps)
    comb_on = family != "hy_v4"
    with torch.no_grad():
        for p in (hc.fn, hc.base, hc.scale, norm.weight):
            p.copy_(torch.randn(p.shape) * (0.1 if p is hc.fn else 1.0))
    t = _inputs(n, d, comb=comb_on, comb_out=comb_on)
    H, f, post, comb = (t[k].requires_grad_(True) if t[k] is not None else None for k in ("H", "f", "post", "comb"))
    params = [hc.fn, hc.base, hc.scale, norm.weight]
    if family == "hy_v4":
        H2 = (post.float().unsqueeze(-1) * f.float().unsqueeze(-2) + H.float()).to(H.dtype)
        post2, collapsed = hc(H2)
        want = (norm(collapsed), H2, post2)
        kw = dict(post_mult=cfg.hc_magnitude, post_eps=cfg.hc_eps)
    else:
        H2 = post.to(H.dtype).unsqueeze(-1) * f.unsqueeze(-2) + torch.matmul(comb.to(H.dtype).transpose(-1, -2), H)
        post2, comb2, collapsed = hc(H2)
        want = (norm(collapsed), H2, post2, comb2)
        kw = {}
    got = fuseblock.hc_add_norm(H, f, post, comb, hc.fn, hc.base, hc.scale, norm.weight, iters=cfg.hc_sinkhorn_iters,
                                hc_eps=cfg.hc_eps, eps=cfg.rms_norm_eps, form=family, **kw)
    got = [g for g in got if g is not None]
    leaves = [x for x in (H, f, post, comb) if x is not None] + params
    cots = [torch.randn(w.shape) for w in want]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    g_got = torch.autograd.grad(got, leaves, cots)
    g_want = torch.autograd.grad(want, leaves, cots)
    for a, b in zip(g_got, g_want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.torch_only("the torch path's forms reproduce the modeling code's op order; the kernels their own")
@pytest.mark.parametrize("family", ["deepseek_v4", "hy_v4", "glm5_next"])
def test_head_forms_equal_the_modeling_code_bitwise(family):
    from types import SimpleNamespace

    module, prefix = _family(family)
    n, d = 4, 32
    cfg = SimpleNamespace(hc_mult=n, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=d)
    head = getattr(module, f"{prefix}HyperHead")
    head = head() if family == "glm5_next" else head(cfg)
    norm = getattr(module, f"{prefix}RMSNorm")(d, eps=cfg.rms_norm_eps)
    params = [p for p in (getattr(head, "hc_fn", None), getattr(head, "hc_base", None),
                          getattr(head, "hc_scale", None)) if p is not None]
    with torch.no_grad():
        for p in params + [norm.weight]:
            p.copy_(torch.randn(p.shape) * (0.1 if p.dim() == 2 else 1.0))
    H = torch.randn(2, 3, n, d, requires_grad=True)
    want = norm(head(H))
    fn, base, scale = params if params else (None, None, None)
    got, _ = fuseblock.hc_head(H, fn, base, scale, norm.weight, hc_eps=cfg.hc_eps, eps=cfg.rms_norm_eps, form=family)
    assert torch.equal(got, want)
    cot = torch.randn(want.shape)
    for a, b in zip(torch.autograd.grad(got, [H, *params, norm.weight], cot),
                    torch.autograd.grad(want, [H, *params, norm.weight], cot), strict=True):
        assert torch.equal(a, b)


@pytest.mark.kernel
@pytest.mark.kernel_only("counts the Triton launches")
@pytest.mark.parametrize("comb", [True, False])
def test_one_launch_forward_two_backward_and_what_is_saved(launches, comb):
    """One launch forward; two backward, the fn/base/scale/weight gradients included; kept
    for backward: the inputs, H' (an output) and per token mix (m) and rho, nothing of n*d."""
    t = _inputs(4, 48, comb=comb, comb_out=comb)
    leaves = _leaves(t)
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fuseblock.hc_add_norm(t["H"], t["f"], t["post"], t["comb"], t["fn"], t["base"], t["scale"],
                                    t["weight"], iters=20)
    assert launches("hc_fwd", "hc_bwd") == (1, 0)
    loss = sum((o.float() * torch.randn(o.shape)).sum() for o in out if o is not None)
    torch.autograd.grad(loss, list(leaves.values()))
    assert launches("hc_fwd", "hc_bwd") == (1, 2)
    known = {id(x) for x in (*leaves.values(), out[1])}
    rows, m = 2 * 3, t["fn"].shape[0]
    extra = [x for x in saved if id(x) not in known]
    assert extra and all(x.numel() <= rows * m for x in extra), [tuple(x.shape) for x in extra]
