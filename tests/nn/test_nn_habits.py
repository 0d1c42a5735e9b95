"""The habits of torch.nn that fuseblock's modules keep: normalized_shape as torch's norms
take it, nn.RMSNorm's and nn.LayerNorm's defaults (state_dicts load with no flags),
eps=None as torch's default for the input's dtype, deferred (meta-device) initialization
through reset_parameters, a repr that shows every non-default setting; and weight_offset
(Gemma's (1 + w)) against an independent fp64 formula, on both paths."""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from ref64 import add_norm64, leaf64
from torch import nn

import fuseblock

D = 8


def state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return module


# ----------------------------------------------------------------- normalized_shape
@pytest.mark.parametrize("shape", [D, (D,), [D], torch.Size([D])], ids=["int", "tuple", "list", "Size"])
@pytest.mark.parametrize("cls", ["Norm", "AddNorm"])
def test_normalized_shape_like_torch(cls, shape):
    mod = getattr(fuseblock, cls)(shape)
    assert mod.dim == D and type(mod.dim) is int
    assert mod.normalized_shape == nn.RMSNorm(shape).normalized_shape == (D,)
    assert type(mod.normalized_shape) is tuple


def test_first_parameter_is_named_normalized_shape():
    assert fuseblock.Norm(normalized_shape=D).dim == D
    assert fuseblock.AddNorm(normalized_shape=(D,)).dim == D
    # the stream modules are not torch norms: theirs stays `dim`
    assert fuseblock.PreNormBlock(nn.Identity(), dim=D).norm.dim == D
    assert fuseblock.ResidualStack([nn.Identity()], dim=D).norm_f.dim == D


# ----------------------------------------------------------------- defaults: torch's state_dicts load with no flags
@pytest.mark.parametrize("kind,factory", [("layer", nn.LayerNorm), ("rms", nn.RMSNorm)])
def test_torch_state_dicts_load_with_default_flags(kind, factory):
    theirs = randomize(factory(D))
    ours = fuseblock.Norm(D) if kind == "rms" else fuseblock.Norm(D, kind="layer")
    ours.load_state_dict(theirs.state_dict())  # strict: the same keys
    back = factory(D)
    back.load_state_dict(randomize(ours).state_dict())
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("kind,has_bias", [("rms", False), ("layer", True), ("l2", False)])
def test_bias_default_follows_kind_and_a_bool_overrides(kind, has_bias):
    assert (fuseblock.Norm(D, kind=kind).bias is not None) == has_bias
    assert fuseblock.Norm(D, kind=kind, bias=True).bias is not None
    assert fuseblock.Norm(D, kind=kind, bias=False).bias is None
    block = fuseblock.PreNormBlock(nn.Identity(), D, kind=kind)
    stack = fuseblock.ResidualStack([nn.Identity()], D, kind=kind)
    assert (block.norm.bias is not None) == (stack.blocks[0].norm.bias is not None) == has_bias
    assert (stack.norm_f.bias is not None) == has_bias
    assert (fuseblock.ResidualStack([nn.Identity()], D, kind=kind, bias=not has_bias).norm_f.bias is None) == has_bias


# ----------------------------------------------------------------- eps=None
# torch's default (nn.RMSNorm, F.rms_norm): the machine epsilon of the computation dtype,
# fp32's for fp16, bf16 and fp32 input, fp64's for fp64. Inputs this small make eps move
# the result: mean(x^2) ~ 1e-7, or 1e-16 in fp64.
TORCH_EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-23, torch.float16: 2.0**-23, torch.float64: 2.0**-52}
SMALL = {torch.float32: 3e-4, torch.bfloat16: 3e-4, torch.float16: 3e-4, torch.float64: 1e-8}


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", list(TORCH_EPS), ids=str)
def test_eps_none_is_torchs_default(dtype):
    mod = randomize(fuseblock.Norm(D, eps=None)).to(dtype)
    assert mod.eps is None
    x = (SMALL[dtype] * torch.randn(4, D)).to(dtype)
    ref, _ = add_norm64(x, None, mod.weight, eps=TORCH_EPS[dtype])
    assert_close(F.rms_norm(x, (D,), mod.weight, eps=None), ref, dtype, "torch's rms_norm")  # the same reading
    for name, out in (("Norm", mod(x)), ("naive", mod.naive(x)), ("norm", fuseblock.norm(x, mod.weight, eps=None))):
        assert out.dtype == dtype
        assert_close(out, ref, dtype, name)
    fixed, _ = add_norm64(x, None, mod.weight, eps=1e-6)
    assert ((mod(x).double() - fixed).abs().max() / fixed.abs().max()).item() > 0.1  # eps did matter


@pytest.mark.kernel
@pytest.mark.parametrize("x_dtype,r_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float64)],
                         ids=["bf16+fp32", "fp32+fp64"])
def test_eps_none_resolves_for_the_normalized_sum(x_dtype, r_dtype):
    """add_norm normalizes p = x + residual, in the dtype torch's sum has: eps=None is what
    F.rms_norm(x + residual) uses, in the function and the module alike."""
    mod = randomize(fuseblock.AddNorm(D, eps=None))
    x, r = (SMALL[x_dtype] * torch.randn(3, D)).to(x_dtype), (SMALL[r_dtype] * torch.randn(3, D)).to(r_dtype)
    want = F.rms_norm(x + r, (D,), mod.weight.to(r_dtype), eps=None)
    for name, out in (("AddNorm", mod(x, r)[0]), ("add_norm", fuseblock.add_norm(x, r, mod.weight, eps=None)[0])):
        assert_close(out, want, x_dtype, name)


@pytest.mark.kernel
def test_eps_none_in_every_module():
    block = fuseblock.PreNormBlock(nn.Identity(), D, eps=None)
    stack = fuseblock.ResidualStack([nn.Identity(), nn.Identity()], D, eps=None)
    assert fuseblock.AddNorm(D, eps=None).eps is None and block.norm.eps is None
    assert [n.eps for n in stack.modules() if isinstance(n, fuseblock.Norm)] == [None] * 3
    x, r = SMALL[torch.float32] * torch.randn(3, D), SMALL[torch.float32] * torch.randn(3, D)
    want, _ = add_norm64(x, r, block.norm.weight, eps=TORCH_EPS[torch.float32])
    assert_close(block(x, r)[0], want, torch.float32, "PreNormBlock")


@pytest.mark.kernel
@pytest.mark.parametrize("act,stream", [(torch.bfloat16, torch.float32), (torch.float32, torch.float64)],
                         ids=["bf16-on-fp32", "fp32-on-fp64"])
def test_eps_none_stream_fused_and_naive_agree(act, stream):
    """Activations over a wider stream: each norm reads the stream (p in the fused form, x_k
    in the naive one), so eps=None resolves for the stream's dtype in both forms. The first
    block sees inputs small enough that eps moves its result."""
    stack = randomize(fuseblock.ResidualStack([nn.Identity(), nn.Identity()], D, eps=None, residual_dtype=stream))
    stack.to(act)
    x = (SMALL[stream] * torch.randn(4, D)).to(act)
    eps = TORCH_EPS[stream]
    h = x.double()
    for blk in stack.blocks:  # x_k = x_{k-1} + N(x_{k-1}) by hand, in fp64
        h = h + F.rms_norm(h, (D,), blk.norm.weight.double(), eps)
    want = F.rms_norm(h, (D,), stack.norm_f.weight.double(), eps)
    fused = stack(x)
    stack.fused = False
    naive = stack(x)
    tol = 2.0**-5 if act == torch.bfloat16 else 1e-5
    for name, got in (("fused", fused), ("naive", naive)):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err <= tol, f"{name}: {err:.3g} from fp64"


# ----------------------------------------------------------------- reset_parameters and meta-device init
# (id, factory(**factory_kwargs)): every fuseblock module that owns parameters or buffers
MODULES = {
    "Norm": lambda **f: fuseblock.Norm(D, **f),
    "Norm-layer": lambda **f: fuseblock.Norm(D, kind="layer", **f),
    "Norm-offset": lambda **f: fuseblock.Norm(D, weight_offset=1.0, **f),
    "AddNorm": lambda **f: fuseblock.AddNorm(D, bias=True, **f),
    "AddNorm-offset": lambda **f: fuseblock.AddNorm(D, kind="layer", weight_offset=0.5, **f),
    "BatchNorm": lambda **f: fuseblock.BatchNorm(D, **f),
    "BatchNorm-noaffine": lambda **f: fuseblock.BatchNorm(D, affine=False, **f),
    "InstanceNorm-affine": lambda **f: fuseblock.InstanceNorm(D, affine=True, **f),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_meta_to_empty_reset_equals_eager(name):
    eager = MODULES[name]()
    meta = MODULES[name](device="meta")
    assert all(t.is_meta for t in meta.state_dict().values())  # nothing allocated
    meta.to_empty(device="cpu")
    with torch.no_grad():  # to_empty leaves whatever memory held: make that garbage certain
        for t in meta.state_dict().values():
            t.fill_(7 if t.dtype == torch.long else float("nan"))
    meta.reset_parameters()
    want, got = state(eager), state(meta)
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_initial_values():
    assert torch.equal(fuseblock.Norm(D).weight, torch.ones(D))
    assert torch.equal(fuseblock.Norm(D, kind="layer").bias, torch.zeros(D))
    assert torch.equal(fuseblock.Norm(D, weight_offset=1.0).weight, torch.zeros(D))  # (1 + 0): the plain norm


@pytest.mark.parametrize("name", list(MODULES))
def test_reset_parameters_undoes_training(name):
    mod = MODULES[name]()
    fresh = state(mod)
    with torch.no_grad():
        for t in mod.state_dict().values():
            t.add_(3)
    mod.reset_parameters()
    for k, v in state(mod).items():
        assert torch.equal(v, fresh[k]), k


def test_batch_norm_reset_matches_nn_batchnorm1d():
    ref, mod = nn.BatchNorm1d(D), fuseblock.BatchNorm(D)
    x = torch.randn(5, D)
    ref(x), mod(x)
    ref.reset_parameters(), mod.reset_parameters()
    for k, v in ref.state_dict().items():
        assert torch.equal(mod.state_dict()[k], v), k


@pytest.mark.parametrize("cls", ["PreNormBlock", "ResidualStack"])
def test_stream_modules_on_meta_reset_their_norms_by_the_apply_pattern(cls):
    """FSDP2-style deferred init: build on meta, to_empty, then every module's own
    reset_parameters. The stream modules have none of their own (they would re-init the
    user's mixers); their norms reset to the eager values, and nothing is left unset."""
    def build():
        mixers = [nn.Linear(D, D), nn.Linear(D, D)]
        return (fuseblock.PreNormBlock(mixers[0], D, kind="layer", weight_offset=1.0) if cls == "PreNormBlock"
                else fuseblock.ResidualStack(mixers, D, kind="layer", weight_offset=1.0))

    eager = build()
    with torch.device("meta"):
        meta = build()
    assert not hasattr(meta, "reset_parameters")
    meta.to_empty(device="cpu")
    with torch.no_grad():
        for t in meta.state_dict().values():
            t.fill_(float("nan"))
    meta.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    got, want = state(meta), state(eager)
    assert list(got) == list(want)
    for k, v in got.items():
        assert torch.isfinite(v).all(), k
        if "norm" in k:
            assert torch.equal(v, want[k]), k


# ----------------------------------------------------------------- extra_repr
REPRS = [
    (lambda: fuseblock.Norm(D), "Norm((8,), kind='rms', eps=None)"),
    (lambda: fuseblock.Norm((D,), kind="layer", eps=1e-5), "Norm((8,), kind='layer', eps=1e-05)"),
    (lambda: fuseblock.Norm(D, kind="layer", bias=False, eps=None), "Norm((8,), kind='layer', eps=None, bias=False)"),
    (lambda: fuseblock.Norm(D, weight=False, bias=True), "Norm((8,), kind='rms', eps=None, weight=False, bias=True)"),
    (
        lambda: fuseblock.Norm(D, kind="l2", c=2.0, num_groups=2, gate_act="sigmoid", gate_position="pre",
                               weight_offset=1.0),
        "Norm((8,), kind='l2', eps=None, c=2.0, num_groups=2, gate_act='sigmoid', gate_position='pre', "
        "weight_offset=1.0)",
    ),
    (lambda: fuseblock.AddNorm(D, residual_dtype=torch.float32),
     "AddNorm((8,), kind='rms', eps=None, residual_dtype=torch.float32)"),
]


@pytest.mark.parametrize("make,text", REPRS, ids=[t for _, t in REPRS])
def test_repr(make, text):
    assert repr(make()) == text


NON_DEFAULT = dict(kind="layer", c=2.0, eps=1e-5, weight=False, bias=True, num_groups=2, gate_act="sigmoid",
                   gate_position="pre", weight_offset=1.0)


@pytest.mark.parametrize("key", list(NON_DEFAULT))
def test_repr_shows_each_non_default_setting(key):
    kw = {key: NON_DEFAULT[key]}
    if key == "kind":
        assert "kind='layer'" in repr(fuseblock.Norm(D, **kw))
    else:
        assert f"{key}={NON_DEFAULT[key]!r}" in repr(fuseblock.Norm(D, **kw))


def test_stream_reprs_show_their_norms_settings():
    stack = fuseblock.ResidualStack([nn.Identity()], D, eps=None, weight_offset=1.0, residual_dtype=torch.float32)
    text = repr(stack)
    assert "fused=True, residual_dtype=torch.float32" in text
    assert text.count("AddNorm((8,), kind='rms', eps=None, weight_offset=1.0, residual_dtype=torch.float32)") == 2


# ----------------------------------------------------------------- weight_offset
def gemma64(x, w, eps, offset=1.0):
    """Gemma's RMSNorm, written out in fp64: x / sqrt(mean(x^2) + eps) * (offset + w)."""
    x, w = x.double(), w.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (offset + w)


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_offset_is_gemmas_norm_both_forms(dtype):
    mod = randomize(fuseblock.Norm(D, eps=1e-6, weight_offset=1.0)).to(dtype)
    x = torch.randn(5, D).to(dtype).requires_grad_(True)
    x64, w64 = leaf64(x), leaf64(mod.weight)
    ref = gemma64(x64, w64, 1e-6)
    cot = torch.randn(5, D).to(dtype)
    want = torch.autograd.grad(ref, [x64, w64], cot.double())
    for form in (mod, mod.naive):
        out = form(x)
        assert out.dtype == dtype
        assert_close(out, ref, dtype, "out")
        for name, g, w in zip(["x", "weight"], torch.autograd.grad(out, [x, mod.weight], cot), want, strict=True):
            assert g.dtype == dtype
            assert_close(g, w, dtype, f"d{name}")


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_add_norm_module_weight_offset_equals_the_shifted_weight(kind):
    """AddNorm(weight_offset=a) with weight w is the fp64 reference with weight a + w; the
    gradient of w is the shifted weight's."""
    mod = randomize(fuseblock.AddNorm(D, kind=kind, weight_offset=0.5))
    x, r = torch.randn(3, D, requires_grad=True), torch.randn(3, D, requires_grad=True)
    out, new_r = mod(x, r)
    leaves = [x, r, *mod.parameters()]
    l64 = [leaf64(t) for t in leaves]
    ref, ref_p = add_norm64(l64[0], l64[1], 0.5 + l64[2], l64[3] if kind == "layer" else None, kind=kind)
    assert_close(out, ref, torch.float32, "out")
    assert_close(new_r, ref_p, torch.float32, "new_residual")
    c_out, c_res = torch.randn_like(out), torch.randn_like(new_r)
    got = torch.autograd.grad((out * c_out).sum() + (new_r * c_res).sum(), leaves)
    want = torch.autograd.grad((ref * c_out.double()).sum() + (ref_p * c_res.double()).sum(), l64)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g, w, torch.float32, f"grad {i}")


@pytest.mark.kernel
def test_fresh_module_with_offset_is_the_plain_norm():
    x = torch.randn(3, D)
    plain, offset = fuseblock.Norm(D), fuseblock.Norm(D, weight_offset=1.0)
    torch.testing.assert_close(offset(x), plain(x))
    torch.testing.assert_close(offset.naive(x), plain.naive(x))
    # and a checkpoint's weight means (1 + w): a Gemma weight of 0.5 scales by 1.5
    with torch.no_grad():
        offset.weight.fill_(0.5)
    torch.testing.assert_close(offset(x), 1.5 * plain(x))
    assert math.isclose(offset.weight_offset, 1.0)


# ----------------------------------------------------------------- torch's default eps
def _small(*shape):
    """Rows of RMS about 1e-3: where eps = 1e-6 and torch's defaults part (24% for rms)."""
    return 1e-3 * torch.randn(*shape)


@pytest.mark.kernel
def test_the_default_eps_is_torchs_for_modules_and_functions():
    x, r = _small(4, 3, D), _small(4, 3, D)
    rms, layer = randomize(nn.RMSNorm(D)), randomize(nn.LayerNorm(D))
    cases = [
        ("Norm(d) = nn.RMSNorm(d)", lambda: fuseblock.Norm(D), rms, x),
        ("Norm(d, kind='layer') = nn.LayerNorm(d)", lambda: fuseblock.Norm(D, kind="layer"), layer, x),
        ("Norm(d, 1e-3) = nn.RMSNorm(d, 1e-3)", lambda: fuseblock.Norm(D, 1e-3), randomize(nn.RMSNorm(D, 1e-3)), x),
        ("AddNorm(d)(x)", lambda: fuseblock.AddNorm(D), rms, x),
    ]
    for what, make, twin, inp in cases:
        mod = make()
        mod.load_state_dict(twin.state_dict())
        assert_close(_first(mod(inp)), twin(inp), torch.float32, what, per_row=True)
    w, b = rms.weight, layer.bias
    assert_close(fuseblock.norm(x, w), F.rms_norm(x, (D,), w), torch.float32, "norm = F.rms_norm", per_row=True)
    assert_close(fuseblock.norm(x, layer.weight, b, kind="layer"), F.layer_norm(x, (D,), layer.weight, b),
                 torch.float32, "norm(kind='layer') = F.layer_norm", per_row=True)
    out, p = fuseblock.add_norm(x, r, w)
    assert_close(out, F.rms_norm(x + r, (D,), w), torch.float32, "add_norm = F.rms_norm(x + r)", per_row=True)
    out = fuseblock.add_norm(x, r, layer.weight, b, kind="layer")[0]
    assert_close(out, F.layer_norm(x + r, (D,), layer.weight, b), torch.float32, "add_norm(layer)", per_row=True)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def test_eps_is_the_second_positional_argument_as_in_torch():
    assert fuseblock.Norm(D, 1e-3).eps == nn.RMSNorm(D, 1e-3).eps == 1e-3
    assert fuseblock.AddNorm(D, 1e-3).eps == 1e-3
    assert fuseblock.Norm(D).eps is None and fuseblock.Norm(D, kind="layer").eps is None  # resolved per call
    with pytest.raises(TypeError):
        fuseblock.Norm(D, 1e-3, "layer")  # kind stays a keyword


# ----------------------------------------------------------------- gate is keyword-only
@pytest.mark.kernel
def test_a_residual_passed_positionally_is_never_taken_as_a_gate():
    """flash-attention's habit `norm(x, residual)` must not silently return N(x) * silu(residual)."""
    x, r = torch.randn(2, D), torch.randn(2, D)
    with pytest.raises(TypeError, match=r"^Norm.forward\(\) takes x positionally, got 2 positional arguments: gate "
                                        r"is keyword-only .*AddNorm or Norm.add"):
        fuseblock.Norm(D)(x, r)
    gated = fuseblock.Norm(D)(x, gate=r)  # by keyword it gates
    assert_close(gated, F.rms_norm(x, (D,)) * F.silu(r), torch.float32, "gate=")


@pytest.mark.parametrize("call,name", [
    (lambda x, r: fuseblock.AddNorm(D)(x, r, r), "AddNorm.forward"),
    (lambda x, r: fuseblock.Norm(D).add(x, r, r), "Norm.add"),
    (lambda x, r: fuseblock.add_norm(x, r, None, None, r), "add_norm"),
    (lambda x, r: fuseblock.norm(x, None, None, r), "norm"),
])
def test_every_op_with_a_gate_says_gate_is_keyword_only(call, name):
    """A tensor past the positional arguments (a gate meant, or a residual) gets one line
    saying so, as the README's bad-input table promises, not Python's bare count."""
    x, r = torch.randn(2, D), torch.randn(2, D)
    with pytest.raises(TypeError, match=rf"^{name}\(\) takes .* positionally, got \d positional arguments: "
                                        r"gate is keyword-only \(gate=\.\.\.\)"):
        call(x, r)


# ----------------------------------------------------------------- new_residual's requires_grad
@pytest.mark.kernel
@pytest.mark.parametrize("residual_dtype", [None, torch.float64], ids=["promoted", "fp64"])
def test_new_residual_needs_no_grad_when_only_the_weight_does(residual_dtype):
    """As torch's x + r: only x and residual feed new_residual, on both paths."""
    x, r, w = torch.randn(2, D), torch.randn(2, D), torch.ones(D, requires_grad=True)
    out, p = fuseblock.add_norm(x, r, w, residual_dtype=residual_dtype)
    assert out.requires_grad and not p.requires_grad
    out.sum().backward()
    assert w.grad is not None
    x.requires_grad_(True)
    out, p = fuseblock.add_norm(x, r, w, residual_dtype=residual_dtype)
    assert p.requires_grad
    (out.sum() + p.sum()).backward()
    assert x.grad is not None


# ----------------------------------------------------------------- Norm.add, Norm.add_linear
@pytest.mark.kernel
@pytest.mark.parametrize("cls", ["Norm", "AddNorm"])
def test_add_and_add_linear_use_the_modules_own_settings(cls):
    """Norm.add is add_norm, and Norm.add_linear norm_linear, with every setting of the
    module (kind, eps, bias, weight_offset, an AddNorm's residual_dtype): values and gradients
    against the functional calls with the settings written out."""
    kw = dict(kind="layer", eps=1e-3, weight_offset=1.0)
    if cls == "AddNorm":
        kw["residual_dtype"] = torch.float64
    mod = randomize(getattr(fuseblock, cls)(D, **kw))
    lin = nn.Linear(D, 5)
    x, r = torch.randn(3, D, requires_grad=True), torch.randn(3, D, requires_grad=True)
    rdtype = kw.get("residual_dtype")
    written = dict(kind="layer", eps=1e-3, weight_offset=1.0, residual_dtype=rdtype)
    pairs = [
        ("add", mod.add(x, r), fuseblock.add_norm(x, r, mod.weight, mod.bias, **written)),
        ("add_linear", mod.add_linear(x, r, lin),
         fuseblock.norm_linear(x, r, mod.weight, mod.bias, lin.weight, lin.bias, **written)),
    ]
    leaves = [x, r, mod.weight, mod.bias, lin.weight, lin.bias]
    for what, got, want in pairs:
        assert got[1].dtype == want[1].dtype == (rdtype or torch.float32), what
        for g, w in zip(got, want, strict=True):
            assert_close(g, w, torch.float32, what)
        seeds = [torch.randn_like(t) for t in got]
        def grads(outs, seeds=seeds):
            loss = sum((t * s).sum() for t, s in zip(outs, seeds, strict=True))
            return torch.autograd.grad(loss, leaves, allow_unused=True)

        gg, gw = grads(got), grads(want)
        for i, (a, b) in enumerate(zip(gg, gw, strict=True)):
            assert (a is None) == (b is None), (what, i)
            if a is not None:
                assert_close(a, b, torch.float32, f"{what}: gradient {i}")


def test_add_linear_refuses_what_norm_linear_cannot_do():
    x = torch.randn(2, D)
    with pytest.raises(ValueError, match="num_groups"):
        fuseblock.Norm(D, num_groups=2).add_linear(x, None, nn.Linear(D, 4))
    with pytest.raises(ValueError, match="c="):
        fuseblock.Norm(D, c=1.0).add_linear(x, None, nn.Linear(D, 4))
    with pytest.raises(TypeError, match="linear must be an nn.Linear"):
        fuseblock.Norm(D).add_linear(x, None, nn.Identity())


@pytest.mark.parametrize("hook", ["pre", "post"])
def test_add_linear_refuses_a_linear_whose_hooks_it_would_skip(hook):
    """The fused norm + Linear reads the Linear's parameters and never calls its forward: a
    hook on it (a user's, FSDP2's unshard, torch's ColwiseParallel input gather) would not
    run, so the call is refused rather than silently different from norm, then Linear."""
    x, lin = torch.randn(2, D), nn.Linear(D, 4)
    seen = []
    if hook == "pre":
        lin.register_forward_pre_hook(lambda mod, args: seen.append(1))
    else:
        lin.register_forward_hook(lambda mod, args, out: out * 2)
    with pytest.raises(ValueError, match="has forward hooks, which the fused norm"):
        fuseblock.Norm(D).add_linear(x, None, lin)
    assert seen == []
