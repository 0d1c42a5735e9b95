"""Attention residuals, `attn_res_norm` and `attn_res_add_norm`, on both paths: values and
every gradient against an fp64 reference written here from the formulas (docs/stream.md),
S from 1 to 16, both value forms, strided banks, wide rows, gradcheck, torch.compile,
bad input, launches and what the backward keeps."""
import math

import pytest
import torch
from helpers import KERNEL_PATH, assert_close, interpreted_only

import fuseblock

F32, BF16 = torch.float32, torch.bfloat16


# ---------------------------------------------------------------- the fp64 reference, from the formulas
def attn_res64(sources, partial, branch, query, weight, *, scale, normed, key_eps=1e-6, eps=1e-6, stored=None):
    """(y, mixed, partial') in fp64. stored: the sources' dtype, which partial' and mixed are
    rounded to (straight-through, as the op stores them)."""
    def rounded(t):
        return t if stored is None else t + (t.to(stored).double() - t).detach()

    v = sources.double()
    new = None
    if branch is not None:
        new = rounded(branch.double() + (0.0 if partial is None else partial.double()))
        v = torch.cat([v, new.unsqueeze(-2)], dim=-2)
    k = v / torch.sqrt((v * v).mean(-1, keepdim=True) + key_eps)
    a = torch.softmax(scale * torch.einsum("...jd,d->...j", k, query.double()), dim=-1)
    mixed = rounded(torch.einsum("...j,...jd->...d", a, k if normed else v))
    y = mixed / torch.sqrt((mixed * mixed).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    return y, mixed, new


def _inputs(s, d, *, lead=(2, 3), dtype=F32, update=False, partial=False, weight=True):
    nb = s - 1 if update else s
    t = dict(sources=torch.randn(*lead, nb, d, dtype=dtype) * (1 + torch.rand(*lead, nb, 1)).to(dtype),
             branch=torch.randn(*lead, d, dtype=dtype) if update else None,
             partial=torch.randn(*lead, d, dtype=dtype) if update and partial else None,
             query=torch.randn(d) / math.sqrt(d) * 3, weight=1 + 0.2 * torch.randn(d) if weight else None)
    return {k: v.requires_grad_(True) if v is not None else None for k, v in t.items()}


def _call(t, **kw):
    if t["branch"] is None:
        return fuseblock.attn_res_norm(t["sources"], t["query"], t["weight"], **kw)
    return fuseblock.attn_res_add_norm(t["sources"], t["branch"], t["partial"], t["query"], t["weight"], **kw)


def _check(t, dtype, *, scale=1.0, normed=False, sources=None, cond=1.0, form="fused"):
    """The op on t (sources replaced by a view of the same values, if given) against attn_res64:
    values and every leaf's gradient, a random cotangent on each output."""
    args = dict(t, sources=t["sources"] if sources is None else sources)
    got = [o for o in _call(args, scale=scale, normed_values=normed, form=form) if o is not None]
    ref = [r for r in attn_res64(args["sources"], t["partial"], t["branch"], t["query"], t["weight"], scale=scale,
                                 normed=normed, stored=dtype if dtype != F32 else None) if r is not None]
    assert all(o.dtype == t["sources"].dtype for o in got)
    errs = {}
    for i, (o, r) in enumerate(zip(got, ref, strict=True)):
        assert_close(o, r, dtype, f"output {i}", cond=cond)
        errs[f"out{i}"] = (o.double() - r).abs().max().item()
    cots = [torch.randn(o.shape, dtype=torch.float64) for o in got]
    leaves = {k: v for k, v in t.items() if v is not None}
    grads = torch.autograd.grad(sum((o.double() * c).sum() for o, c in zip(got, cots, strict=True)),
                                list(leaves.values()))
    refs = torch.autograd.grad(sum((r * c).sum() for r, c in zip(ref, cots, strict=True)), list(leaves.values()))
    for (name, leaf), g, rg in zip(leaves.items(), grads, refs, strict=True):
        assert g.dtype == leaf.dtype, name
        assert_close(g, rg, dtype, f"d{name}", cond=cond)
        errs[f"d{name}"] = (g.double() - rg).abs().max().item()
    return errs


CASES = [  # (S, update, partial, normed, dtype)
    (1, False, False, False, F32), (2, True, False, True, F32), (2, True, True, False, BF16),
    (3, False, False, True, BF16), (4, True, True, False, F32), (4, True, True, True, F32),
    (5, True, False, False, F32), (8, False, False, False, BF16), (9, True, True, True, F32),
    (16, True, True, False, F32), (16, False, False, True, BF16),
]


@pytest.mark.kernel
@pytest.mark.parametrize("s,update,partial,normed,dtype", CASES)
def test_against_fp64(s, update, partial, normed, dtype):
    torch.manual_seed(s)
    t = _inputs(s, 24, dtype=dtype, update=update, partial=partial)
    # bf16: partial' and mixed carry one rounding each (the reference rounds the same values)
    _check(t, dtype, scale=24 ** -0.5 if normed else 1.0, normed=normed, cond=4.0 if dtype == BF16 else 1.0)


@pytest.mark.kernel
@pytest.mark.parametrize("s,update,partial,dtype", [(1, False, False, F32), (5, True, True, F32),
                                                    (4, True, False, BF16)])
def test_inkling2_form_against_fp64(s, update, partial, dtype):
    """form "inkling2" (the torch path in Inkling2BlockAttentionResidual's order: two batched
    matmuls; the kernels' order unchanged) holds to the same reference, both value forms."""
    torch.manual_seed(s)
    t = _inputs(s, 24, dtype=dtype, update=update, partial=partial)
    _check(t, dtype, scale=24 ** -0.5, normed=True, form="inkling2", cond=4.0 if dtype == BF16 else 1.0)
    _check(t, dtype, normed=False, form="inkling2", cond=4.0 if dtype == BF16 else 1.0)


@pytest.mark.kernel
def test_no_weight_and_large_scale():
    """No weight; scores of tens (a near one-hot softmax)."""
    torch.manual_seed(1)
    _check(_inputs(6, 20, update=True, partial=True, weight=False), F32, scale=8.0)


@pytest.mark.kernel
@pytest.mark.parametrize("layout", ["sliced", "source-major", "columns"])
def test_strided_banks(layout):
    """A bank kept per token, read in place: every other slot of a larger bank, a
    source-major (S, tokens, d) buffer, and columns of stride 2 (copied)."""
    torch.manual_seed(2)
    t = _inputs(5, 16, lead=(6,), update=True, partial=True)
    src = t["sources"]  # (6, 4, 16)
    if layout == "sliced":
        buf = torch.zeros(6, 8, 16)
        buf[:, ::2] = src.detach()
        view = buf.requires_grad_()[:, ::2]
    elif layout == "source-major":
        view = src.detach().transpose(0, 1).contiguous().requires_grad_().transpose(0, 1)
    else:
        buf = torch.zeros(6, 4, 32)
        buf[..., ::2] = src.detach()
        view = buf.requires_grad_()[..., ::2]
    assert not view.is_contiguous()
    got = fuseblock.attn_res_add_norm(view, t["branch"], t["partial"], t["query"], t["weight"])
    want = attn_res64(src, t["partial"], t["branch"], t["query"], t["weight"], scale=1.0, normed=False)
    for o, r in zip(got, want, strict=True):
        assert_close(o, r, F32, "value")
    cot = torch.randn(got[0].shape)
    g, = torch.autograd.grad((got[0] * cot).sum(), [view])
    rg, = torch.autograd.grad((want[0] * cot.double()).sum(), [src])
    assert_close(g, rg, F32, "dsources")


@pytest.mark.kernel
def test_wide_rows_and_programs_walking_token_blocks(monkeypatch):
    """Rows of several column chunks in every pass (d = 70 in chunks of 16) and backward
    programs that each walk several token blocks (partial rows added to across them)."""
    if KERNEL_PATH:
        import fuseblock.kernels.attn_res as K
        import fuseblock.kernels.launch as L

        monkeypatch.setattr(K, "TILE_FWD", 64)
        monkeypatch.setattr(K, "TILE_BWD", 64)
        monkeypatch.setattr(K, "PROGRAMS_PER_SM", 1)
        monkeypatch.setattr(L, "H100_SMS", 2)
    torch.manual_seed(3)
    _check(_inputs(4, 70, lead=(5,), update=True, partial=True), F32, normed=True, scale=0.3)


def test_gradcheck_fp64_torch_path():
    torch.manual_seed(4)
    t = {k: (v.detach().double().requires_grad_() if v is not None else None)
         for k, v in _inputs(3, 6, lead=(2,), update=True, partial=True).items()}
    for normed in (False, True):
        def f(sources, branch, partial, query, weight, normed=normed):
            return fuseblock.attn_res_add_norm(sources, branch, partial, query, weight, scale=0.7,
                                               normed_values=normed)
        assert torch.autograd.gradcheck(f, tuple(t.values()))


@pytest.mark.kernel
def test_one_source_no_update_is_the_norm():
    """S = 1: a = 1, mixed = the source, y = rms_norm(source, weight)."""
    torch.manual_seed(5)
    t = _inputs(1, 32)
    y, mixed = _call(t)
    assert torch.equal(mixed, t["sources"].squeeze(-2))
    want = fuseblock.norm(t["sources"].squeeze(-2), t["weight"], kind="rms", eps=1e-6)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)


@pytest.mark.kernel
def test_compile_fullgraph_no_break():
    t = _inputs(4, 16, update=True, partial=True)
    leaves = {k: v for k, v in t.items() if v is not None}

    def step(sources, branch, partial, query, weight):
        y, mixed, new = fuseblock.attn_res_add_norm(sources, branch, partial, query, weight)
        return y.sum() + mixed.square().sum() + (new * new).sum()

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(*leaves.values())
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert ("fuseblock.attn_res_fwd" in str(explained.graphs[0].graph)) == KERNEL_PATH
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(*leaves.values()), list(leaves.values()))
    want = torch.autograd.grad(step(*leaves.values()), list(leaves.values()))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,match", [
    (dict(sources=torch.randn(2, 17, 8)), "sources' count S"),
    (dict(sources=torch.randn(2, 0, 8)), "sources' count S"),
    (dict(sources=torch.randn(8)), "sources must have shape"),
    (dict(query=torch.randn(9)), "query must have shape"),
    (dict(weight=torch.randn(7)), "weight must have shape"),
    (dict(eps=math.nan), "eps must be finite"),
    (dict(key_eps=math.inf), "key_eps must be finite"),
    (dict(key_eps=-1.0), "key_eps must be >= 0"),
    (dict(scale=math.nan), "scale must be finite"),
    (dict(kind="layer"), "kind must be 'rms'"),
    (dict(form="kimi"), "form must be one of"),
])
def test_bad_input_names_the_argument(change, match):
    args = dict(sources=torch.randn(2, 3, 8), query=torch.randn(8), weight=torch.randn(8))
    kw = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        fuseblock.attn_res_norm(*args.values(), **kw)


def test_bad_update_arguments():
    src, q = torch.randn(2, 15, 8), torch.randn(8)
    with pytest.raises(ValueError, match=r"sources' count S .*partial' counted.* got 17"):
        fuseblock.attn_res_add_norm(torch.randn(2, 16, 8), torch.randn(2, 8), None, q, None)
    with pytest.raises(ValueError, match="branch must have shape"):
        fuseblock.attn_res_add_norm(src, torch.randn(2, 9), None, q, None)
    with pytest.raises(ValueError, match="partial must have shape"):
        fuseblock.attn_res_add_norm(src, torch.randn(2, 8), torch.randn(3, 8), q, None)
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        fuseblock.attn_res_norm(src, [0.0] * 8, None)
    with pytest.raises(TypeError, match="normed_values must be a bool"):
        fuseblock.attn_res_norm(src, q, None, normed_values=1)


def test_dtensors_refused_by_name():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        src = distribute_tensor(torch.randn(2, 3, 8), init_device_mesh("cpu", (1,)), [Replicate()])
        with pytest.raises(TypeError, match="takes no DTensors"):
            fuseblock.attn_res_norm(src, torch.randn(8), None)
    finally:
        dist.destroy_process_group()


@pytest.mark.kernel
@pytest.mark.kernel_only("counts the Triton launches")
def test_one_launch_forward_two_backward_and_what_is_saved(launches):
    """One launch forward; two backward (query's and weight's gradients from partial rows);
    kept for backward: the inputs, partial' (an output) and per token S softmax weights,
    S key statistics and one rstd: nothing of S*d."""
    t = _inputs(9, 32, update=True, partial=True)
    leaves = {k: v for k, v in t.items() if v is not None}
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = _call(t)
    assert launches("attn_res_fwd", "attn_res_bwd") == (1, 0)
    assert launches.total() == 1
    loss = sum((o * torch.randn(o.shape)).sum() for o in out)
    torch.autograd.grad(loss, list(leaves.values()))
    assert launches("attn_res_fwd", "attn_res_bwd") == (1, 2)
    known = {id(x) for x in (*leaves.values(), out[2])}
    extra = [x for x in saved if id(x) not in known]
    assert sorted(tuple(x.shape) for x in extra) == [(6,), (6, 9), (6, 9)], [tuple(x.shape) for x in extra]


@pytest.mark.kernel
@interpreted_only
def test_traffic_sources_read_once_and_fused_against_unfused():
    """bench.py traffic's rows at a tiny size: forward reads each state once and moves the
    minimum's activations; fused moves >= 3x less than Kimi's torch form with one-kernel
    norms; 1 launch forward, 2 backward."""
    from fuseblock.testing.attn_res_traffic import measure_attn_res_traffic

    rows = {r["pas"]: r for r in measure_attn_res_traffic(8, 4, 64, BF16)}
    fwd, bwd, both = rows["fwd"], rows["bwd"], rows["fwd+bwd"]
    assert fwd["sources_read_over_size"] == 1.0 and fwd["act_over_min"] == 1.0 and bwd["act_over_min"] == 1.0
    assert (fwd["launches"], bwd["launches"]) == (1, 2)
    assert both["unfused1_over_kernel"] >= 3.0 and both["unfused_over_kernel"] > both["unfused1_over_kernel"]
    assert fwd["kept_MB"] * 1e6 == 8 * (8 * 4 + 4)  # a, r (S fp32 each) and rho per token
