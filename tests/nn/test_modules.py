"""The modules Norm and AddNorm: values and gradients against torch's nn.RMSNorm and
nn.LayerNorm and the fp64 seed reference, state_dicts both ways, gates, bad arguments."""
import pytest
import torch
from helpers import assert_close
from ref64 import add_norm64, leaf64
from torch import nn

import fuseblock

D = 24
DTYPES = [torch.float32, torch.bfloat16]


def randomize(module):
    """Move weight/bias off their ones/zeros init, so their gradients and loads mean something."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return module


def grads(out, leaves, cot):
    return torch.autograd.grad(out, leaves, cot)


# ----------------------------------------------------------------- against torch's modules
TORCH_TWINS = {
    # id: (fuseblock.Norm kwargs, torch module factory)
    "rms": (dict(kind="rms", eps=1e-6), lambda: nn.RMSNorm(D, eps=1e-6)),
    "rms-noaffine": (
        dict(kind="rms", eps=1e-6, weight=False), lambda: nn.RMSNorm(D, eps=1e-6, elementwise_affine=False)
    ),
    "layer+bias": (dict(kind="layer", eps=1e-5), lambda: nn.LayerNorm(D, eps=1e-5)),  # bias: the layer default
    "layer-nobias": (dict(kind="layer", eps=1e-5, bias=False), lambda: nn.LayerNorm(D, eps=1e-5, bias=False)),
}


@pytest.mark.kernel
@pytest.mark.parametrize("case", list(TORCH_TWINS))
def test_norm_equals_torch_module_values_and_grads(case):
    kwargs, factory = TORCH_TWINS[case]
    ours, theirs = fuseblock.Norm(D, **kwargs), randomize(factory())
    ours.load_state_dict(theirs.state_dict())  # strict: the same keys
    x = torch.randn(3, 5, D, requires_grad=True)
    cot = torch.randn(3, 5, D)
    out, ref = ours(x), theirs(x)
    assert_close(out, ref, torch.float32, "out")
    got = grads(out, [x, *ours.parameters()], cot)
    want = grads(ref, [x, *theirs.parameters()], cot)
    assert len(got) == len(want) == 1 + len(list(theirs.parameters()))
    for name, g, w in zip(["x", "weight", "bias"], got, want, strict=False):
        assert_close(g, w, torch.float32, f"d{name}")


@pytest.mark.parametrize("case", list(TORCH_TWINS))
def test_state_dict_loads_both_ways(case):
    kwargs, factory = TORCH_TWINS[case]
    theirs = randomize(factory())
    ours = fuseblock.Norm(D, **kwargs)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    randomize(ours)
    back = factory()
    back.load_state_dict(ours.state_dict())
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_attributes():
    n = fuseblock.Norm(D, kind="layer", eps=1e-5, bias=True)
    assert (n.kind, n.eps, n.dim) == ("layer", 1e-5, D)
    assert n.weight.shape == (D,) and n.bias.shape == (D,)
    assert fuseblock.Norm(D).bias is None and fuseblock.Norm(D, weight=False).weight is None
    a = fuseblock.AddNorm(D, kind="rms", residual_dtype=torch.float32)
    assert isinstance(a, fuseblock.Norm) and a.residual_dtype == torch.float32 and a.eps is None
    assert "residual_dtype=torch.float32" in repr(a)


# ----------------------------------------------------------------- against the fp64 reference
@pytest.mark.kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "kw",
    [dict(kind="rms"), dict(kind="layer", bias=True), dict(kind="l2"), dict(kind="rms", c=2.0, num_groups=4)],
    ids=["rms", "layer", "l2", "rms-c-groups"],
)
def test_norm_and_its_naive_form_match_fp64(dtype, kw):
    norm = randomize(fuseblock.Norm(D, eps=1e-5, **kw)).to(dtype)
    x = torch.randn(4, D).to(dtype).requires_grad_(True)
    cot = torch.randn(4, D).to(dtype)
    params = list(norm.parameters())
    ref_kw = {k: v for k, v in kw.items() if k != "bias"}
    x64, p64 = leaf64(x), [leaf64(p) for p in params]
    ref, _ = add_norm64(x64, None, p64[0], p64[1] if len(p64) > 1 else None, eps=1e-5, **ref_kw)
    want = grads(ref, [x64, *p64], cot.double())
    for form in (norm, norm.naive):  # naive is the stream's unfused reference: it must agree too
        out = form(x)
        assert out.dtype == dtype
        assert_close(out, ref, dtype, "out")
        for name, g, w in zip(["x", "weight", "bias"], grads(out, [x, *params], cot), want, strict=False):
            assert g.dtype == dtype
            assert_close(g, w, dtype, f"d{name}")


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual_dtype", [None, torch.float32], ids=["res-default", "res-fp32"])
def test_add_norm_module_matches_fp64(dtype, residual_dtype):
    mod = randomize(fuseblock.AddNorm(D, kind="layer", bias=True, residual_dtype=residual_dtype)).to(dtype)
    x = torch.randn(3, D).to(dtype).requires_grad_(True)
    r = torch.randn(3, D).to(residual_dtype or dtype).requires_grad_(True)
    out, new_r = mod(x, r)
    assert out.dtype == dtype and new_r.dtype == (residual_dtype or dtype)
    leaves = [x, r, mod.weight, mod.bias]
    l64 = [leaf64(t) for t in leaves]
    ref, ref_p = add_norm64(*l64, kind="layer")
    assert_close(out, ref, dtype, "out")
    assert_close(new_r, ref_p, new_r.dtype, "new_residual")
    # a gradient arrives at both outputs, as in a residual stream
    c_out, c_res = torch.randn_like(out), torch.randn_like(new_r)
    got = torch.autograd.grad((out.double() * c_out.double()).sum() + (new_r.double() * c_res.double()).sum(), leaves)
    want = torch.autograd.grad((ref * c_out.double()).sum() + (ref_p * c_res.double()).sum(), l64)
    for name, g, w, leaf in zip(["x", "residual", "weight", "bias"], got, want, leaves, strict=True):
        assert g.dtype == leaf.dtype
        assert_close(g, w, leaf.dtype, f"d{name}")


@pytest.mark.kernel
def test_add_norm_module_keeps_a_wider_residual_by_default():
    # the dtype torch's x + residual would have: bf16 activations never round an fp32 stream
    mod = fuseblock.AddNorm(D)
    x, r = torch.randn(2, D).bfloat16(), torch.randn(2, D)
    out, new_r = mod(x, r)
    assert out.dtype == torch.bfloat16 and new_r.dtype == torch.float32
    torch.testing.assert_close(new_r, x.float() + r, rtol=0, atol=0)
    out_none, same = mod(x)
    assert same is x and torch.equal(out_none, fuseblock.norm(x, mod.weight))


# ----------------------------------------------------------------- gates
GATES = [dict(), dict(gate_act="sigmoid"), dict(gate_position="pre"), dict(gate_act="none", gate_position="pre")]


@pytest.mark.kernel
@pytest.mark.parametrize("gate_kw", GATES, ids=["silu-post", "sigmoid-post", "silu-pre", "none-pre"])
@pytest.mark.parametrize("cls", ["Norm", "AddNorm"])
def test_gate_is_passed_through(cls, gate_kw):
    mod = randomize(getattr(fuseblock, cls)(D, kind="rms", bias=True, **gate_kw))
    x, g = torch.randn(3, D, requires_grad=True), torch.randn(3, D, requires_grad=True)
    r = torch.randn(3, D, requires_grad=True) if cls == "AddNorm" else None
    out = mod(x, r, gate=g)[0] if cls == "AddNorm" else mod(x, gate=g)
    leaves = [t for t in (x, r, g, mod.weight, mod.bias) if t is not None]
    l64 = {id(t): leaf64(t) for t in leaves}
    ref, _ = add_norm64(
        l64[id(x)], None if r is None else l64[id(r)], l64[id(mod.weight)], l64[id(mod.bias)],
        gate=l64[id(g)], **gate_kw,
    )
    assert_close(out, ref, torch.float32, "out")
    cot = torch.randn_like(out)
    for g_, w_ in zip(grads(out, leaves, cot), grads(ref, list(l64.values()), cot.double()), strict=True):
        assert_close(g_, w_, torch.float32, "grad")
    # the gate changes the result (it is not silently dropped)
    plain = mod(x, r)[0] if cls == "AddNorm" else mod(x)
    assert not torch.allclose(out, plain)


# ----------------------------------------------------------------- bad arguments
BAD = [
    # (argument named in the message, constructor kwargs, exception)
    ("normalized_shape", dict(normalized_shape=0), ValueError),
    ("normalized_shape", dict(normalized_shape=-3), ValueError),
    ("normalized_shape", dict(normalized_shape=2.5), TypeError),
    ("normalized_shape", dict(normalized_shape=True), TypeError),
    ("normalized_shape", dict(normalized_shape="8"), TypeError),
    ("normalized_shape", dict(normalized_shape=(4, 8)), ValueError),
    ("normalized_shape", dict(normalized_shape=()), ValueError),
    ("normalized_shape", dict(normalized_shape=(8.0,)), TypeError),
    ("normalized_shape", dict(normalized_shape=torch.Size([0])), ValueError),
    ("kind", dict(kind="batch"), ValueError),
    ("eps", dict(eps=-1.0), ValueError),
    ("eps", dict(eps="1e-6"), TypeError),
    ("c", dict(c=float("nan")), ValueError),
    ("num_groups", dict(num_groups=5), ValueError),
    ("num_groups", dict(num_groups=2.0), TypeError),
    ("gate_act", dict(gate_act="relu"), ValueError),
    ("gate_position", dict(gate_position="middle"), ValueError),
    ("weight", dict(weight=torch.ones(8)), TypeError),
    ("bias", dict(bias=1), TypeError),
    ("weight_offset", dict(weight_offset="1"), TypeError),
    ("weight_offset", dict(weight_offset=float("inf")), ValueError),
    ("weight_offset", dict(weight=False, weight_offset=1.0), ValueError),
]


@pytest.mark.parametrize("cls", ["Norm", "AddNorm"])
@pytest.mark.parametrize("arg,kw,exc", BAD, ids=[f"{a}={kw[a]!r}" for a, kw, _ in BAD])
def test_bad_constructor_arguments(cls, arg, kw, exc):
    kw = dict(kw)
    shape = kw.pop("normalized_shape", 8)
    with pytest.raises(exc, match=arg):
        getattr(fuseblock, cls)(shape, **kw)


@pytest.mark.parametrize("bad", [torch.int32, "float32", torch.float8_e4m3fn])
def test_add_norm_rejects_bad_residual_dtype(bad):
    with pytest.raises(TypeError, match="residual_dtype"):
        fuseblock.AddNorm(8, residual_dtype=bad)
