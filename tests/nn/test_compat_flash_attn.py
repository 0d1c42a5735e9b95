"""fuseblock.compat.flash_attn: flash-attention's layer_norm_fn / rms_norm_fn /
layer_norm_linear_fn / RMSNorm signatures, the calls mamba-style code makes, against an
fp64 reference written here (values and gradients, both paths); out_dtype wider than x
computed in fp32 and stored once; dropout by its statistics; what fuseblock lacks
refused by name."""
import inspect

import pytest
import torch
from helpers import assert_close
from ref64 import add_norm64, leaf64
from torch import nn

from fuseblock.compat.flash_attn import RMSNorm, layer_norm_fn, layer_norm_linear_fn, rms_norm_fn

D, ROWS = 16, 6

# flash-attention's signature (flash_attn/ops/triton/layer_norm.py), in order, with defaults
FLASH_LAYER_NORM_FN = [("x", None), ("weight", None), ("bias", None), ("residual", None), ("x1", None),
                       ("weight1", None), ("bias1", None), ("eps", 1e-6), ("dropout_p", 0.0), ("rowscale", None),
                       ("prenorm", False), ("residual_in_fp32", False), ("zero_centered_weight", False),
                       ("is_rms_norm", False), ("return_dropout_mask", False), ("out_dtype", None), ("out", None),
                       ("residual_out", None)]


# flash-attention's layer_norm_linear_fn, in order, with defaults
FLASH_LAYER_NORM_LINEAR_FN = [("x", None), ("norm_weight", None), ("norm_bias", None), ("linear_weight", None),
                              ("linear_bias", None), ("residual", None), ("eps", 1e-6), ("prenorm", False),
                              ("residual_in_fp32", False), ("is_rms_norm", False)]


def params(fn):
    return [(p.name, None if p.default is p.empty else p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_signatures_are_flash_attentions():
    assert params(layer_norm_fn) == FLASH_LAYER_NORM_FN
    assert params(rms_norm_fn) == [p for p in FLASH_LAYER_NORM_FN if p[0] != "is_rms_norm"]
    assert params(layer_norm_linear_fn) == FLASH_LAYER_NORM_LINEAR_FN
    assert params(RMSNorm.forward) == [("self", None), ("x", None), ("residual", None), ("prenorm", False),
                                       ("residual_in_fp32", False)]
    assert params(RMSNorm.__init__)[1:] == [("hidden_size", None), ("eps", 1e-5), ("dropout_p", 0.0),
                                            ("zero_centered_weight", False), ("device", None), ("dtype", None)]


def norm64(s, weight, bias, eps, rms, zero_centered):
    """N(s) in fp64, written out: (s or s - mean) / sqrt(mean square + eps) * (zc + w) + b."""
    q = s if rms else s - s.mean(-1, keepdim=True)
    y = q / torch.sqrt((q * q).mean(-1, keepdim=True) + eps) * ((1.0 if zero_centered else 0.0) + weight)
    return y if bias is None else y + bias


# (name, keywords of the call): the calls mamba's Block and its peers make, and the rest
CASES = {
    "rms-prenorm-residual": dict(rms=True, residual=True, prenorm=True),
    "rms-first-block-fp32": dict(rms=True, prenorm=True, residual_in_fp32=True),
    "rms-plain": dict(rms=True),
    "layer-bias-residual": dict(rms=False, bias=True, residual=True, prenorm=True),
    "layer-x1-residual": dict(rms=False, bias=True, residual=True, x1=True, prenorm=True),
    "rms-x1-noresidual-zc": dict(rms=True, x1=True, prenorm=True, zero_centered_weight=True),
    "rms-bias-zc-eps": dict(rms=True, bias=True, zero_centered_weight=True, eps=1e-3),
}


@pytest.mark.kernel
@pytest.mark.parametrize("case,via", [(case, via) for case, c in CASES.items()
                                      for via in ("layer_norm_fn", "rms_norm_fn")[:2 if c["rms"] else 1]])
def test_against_fp64(case, via):
    c = CASES[case]
    x = (torch.randn(2, ROWS // 2, D) * 2).requires_grad_(True)
    w = (torch.randn(D) * 0.3 + (0.0 if c.get("zero_centered_weight") else 1.0)).requires_grad_(True)
    b = torch.randn(D).requires_grad_(True) if c.get("bias") else None
    r = torch.randn(2, ROWS // 2, D).requires_grad_(True) if c.get("residual") else None
    x1 = torch.randn(2, ROWS // 2, D).requires_grad_(True) if c.get("x1") else None
    eps = c.get("eps", 1e-6)
    kw = dict(residual=r, x1=x1, eps=eps, prenorm=c.get("prenorm", False),
              residual_in_fp32=c.get("residual_in_fp32", False),
              zero_centered_weight=c.get("zero_centered_weight", False))
    got = (layer_norm_fn(x, w, b, is_rms_norm=c["rms"], **kw) if via == "layer_norm_fn"
           else rms_norm_fn(x, w, b, **kw))
    leaves = [t for t in (x, w, b, r, x1) if t is not None]
    leaves64 = [leaf64(t) for t in leaves]
    x64, w64 = leaves64[0], leaves64[1]
    it = iter(leaves64[2:])
    b64, r64, x164 = (next(it) if t is not None else None for t in (b, r, x1))
    s64 = x64 + (0 if x164 is None else x164) + (0 if r64 is None else r64)
    y64 = norm64(s64, w64, b64, eps, c["rms"], kw["zero_centered_weight"])
    cot = torch.randn(x.shape)
    if kw["prenorm"]:
        y, res = got
        assert res.dtype == (torch.float32 if r is None and kw["residual_in_fp32"] else x.dtype)
        assert_close(res, s64, torch.float32, "residual_out")
        cot_r = torch.randn(x.shape)
        outs, outs64, cots = (y, res), (y64, s64), (cot, cot_r)
    else:
        y = got
        outs, outs64, cots = (y,), (y64,), (cot,)
    assert y.dtype == x.dtype
    assert_close(y, y64, torch.float32, "y")
    g = torch.autograd.grad(outs, leaves, cots)
    g64 = torch.autograd.grad(outs64, leaves64, [t.double() for t in cots])
    for i, (a, e) in enumerate(zip(g, g64, strict=True)):
        assert_close(a, e, torch.float32, f"grad {i}")


@pytest.mark.kernel
def test_dtypes_as_flash_attention_keeps_them():
    x = torch.randn(ROWS, D).to(torch.bfloat16)
    w = torch.ones(D)
    # no residual: residual_out in fp32 with residual_in_fp32, else x itself
    y, res = rms_norm_fn(x, w, None, prenorm=True, residual_in_fp32=True)
    assert y.dtype == torch.bfloat16 and res.dtype == torch.float32 and torch.equal(res, x.float())
    y, res = rms_norm_fn(x, w, None, prenorm=True)
    assert res is x
    # a residual keeps its own dtype, whatever residual_in_fp32 says
    r = torch.randn(ROWS, D)
    res = rms_norm_fn(x, w, None, residual=r.bfloat16(), prenorm=True, residual_in_fp32=True)[1]
    assert res.dtype == torch.bfloat16
    assert rms_norm_fn(x, w, None, residual=r, prenorm=True)[1].dtype == torch.float32
    # out_dtype casts y
    assert layer_norm_fn(x, w, None, out_dtype=torch.float32).dtype == torch.float32


@pytest.mark.kernel
def test_dropout_masks_scale_and_gradients():
    p = 0.25
    x = torch.randn(64, 8, D).requires_grad_(True)
    r = torch.randn(64, 8, D)
    torch.manual_seed(3)
    y, res = rms_norm_fn(x, torch.ones(D), None, residual=r, dropout_p=p, prenorm=True)
    branch = res - r
    kept = branch != 0
    # kept elements scaled by 1/(1 - p), the rest zero; about p of them dropped
    assert_close(branch[kept], x.detach()[kept] / (1 - p), torch.float32, "kept")
    assert abs((~kept).float().mean().item() - p) < 0.02
    # y is the norm of what was kept
    assert_close(y, norm64(res.double(), torch.ones(D).double(), None, 1e-6, True, False), torch.float32, "y")
    # the same seed, the same mask; the gradient is zero exactly where x was dropped
    torch.manual_seed(3)
    assert torch.equal(rms_norm_fn(x, torch.ones(D), None, residual=r, dropout_p=p, prenorm=True)[1], res)
    (dx,) = torch.autograd.grad(res.sum(), [x])
    assert torch.equal(dx == 0, ~kept)
    assert_close(dx[kept], torch.full_like(dx[kept], 1 / (1 - p)).double(), torch.float32, "dx")


@pytest.mark.kernel
def test_rms_norm_module():
    norm = RMSNorm(D, eps=1e-6, dropout_p=0.5)
    assert list(norm.state_dict()) == ["weight"] and torch.equal(norm.weight, torch.ones(D))
    assert torch.equal(RMSNorm(D, zero_centered_weight=True).weight, torch.zeros(D))
    with torch.no_grad():
        norm.weight.normal_()
    x, r = torch.randn(ROWS, D), torch.randn(ROWS, D)
    norm.eval()  # no dropout in eval
    y, res = norm(x, r, prenorm=True)
    assert torch.equal(res, x + r)
    assert_close(y, norm64((x + r).double(), norm.weight.double(), None, 1e-6, True, False), torch.float32, "y")
    assert torch.equal(norm(x, r), y)
    norm.train()
    res = norm(x, r, prenorm=True)[1]
    assert ((res - r) == 0).any()  # dropout in training


@pytest.mark.parametrize("kw,error,needle", [
    (dict(rowscale=torch.ones(ROWS)), ValueError, "rowscale"),
    (dict(weight1=torch.ones(D)), ValueError, "weight1"),
    (dict(bias1=torch.ones(D)), ValueError, "bias1"),
    (dict(out=torch.empty(ROWS, D)), ValueError, "out"),
    (dict(residual_out=torch.empty(ROWS, D)), ValueError, "residual_out"),
    (dict(return_dropout_mask=True, dropout_p=0.1), ValueError, "return_dropout_mask"),
    (dict(prenorm="yes"), TypeError, "prenorm"),
    (dict(is_rms_norm=1), TypeError, "is_rms_norm"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(x1=torch.randn(ROWS, D + 1)), ValueError, "x1"),
    (dict(out_dtype="bf16"), TypeError, "out_dtype"),
])
def test_what_fuseblock_lacks_is_refused_by_name(kw, error, needle):
    with pytest.raises(error, match=needle):
        layer_norm_fn(torch.randn(ROWS, D), torch.ones(D), None, **kw)


# ----------------------------------------------------------------- out_dtype wider than x
@pytest.mark.kernel
@pytest.mark.parametrize("case", ["rms-fp32-residual", "layer-bias-residual_in_fp32"])
def test_out_dtype_wider_than_x_is_computed_in_fp32_and_stored_once(case):
    """bf16 x, out_dtype fp32: y is the fp32 result stored once (not rounded to bf16 first:
    it was 7e-3 off), and the gradient at y is read in fp32, so the fp32 residual's and the
    weight's gradients are fp32-exact (the residual's was 6e-3 off), as flash-attention's."""
    rms = case.startswith("rms")
    x = (torch.randn(ROWS, D) * 2).bfloat16().requires_grad_(True)
    w = (torch.randn(D) * 0.3 + 1.0).requires_grad_(True)
    b = None if rms else torch.randn(D).requires_grad_(True)
    r = torch.randn(ROWS, D).requires_grad_(True) if rms else None
    y, res = layer_norm_fn(x, w, b, residual=r, prenorm=True, residual_in_fp32=not rms, is_rms_norm=rms,
                           out_dtype=torch.float32)
    assert y.dtype == torch.float32 and res.dtype == torch.float32
    leaves = [t for t in (x, w, b, r) if t is not None]
    leaves64 = [leaf64(t) for t in leaves]
    x64, w64 = leaves64[:2]
    b64, r64 = (leaves64[2], None) if b is not None else (None, leaves64[2])
    y64, p64 = add_norm64(x64, r64, w64, b64, kind="rms" if rms else "layer", eps=1e-6,
                          residual_dtype=torch.float32)
    assert_close(y, y64, torch.float32, "y")
    cot, cot_r = torch.randn(ROWS, D), torch.randn(ROWS, D)
    got = torch.autograd.grad((y, res), leaves, (cot, cot_r))
    want = torch.autograd.grad((y64, p64), leaves64, (cot.double(), cot_r.double()))
    for t, g, e, name in zip(leaves, got, want, ("x", "weight", "bias" if b is not None else "residual"),
                             strict=True):
        assert g.dtype == t.dtype  # x's in bf16 (one rounding), the rest fp32-exact
        assert_close(g, e, t.dtype, f"grad {name}")


@pytest.mark.kernel
def test_out_dtype_narrower_than_x_rounds_once():
    """fp32 x, out_dtype bf16: the fp32 result rounded once to bf16 (one bf16 rounding off
    the fp64 reference), its bf16 gradient read as it comes."""
    x, w = torch.randn(ROWS, D, requires_grad=True), (torch.randn(D) + 1.0).requires_grad_(True)
    y = rms_norm_fn(x, w, None, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    x64, w64 = leaf64(x), leaf64(w)
    y64 = add_norm64(x64, None, w64, eps=1e-6)[0]
    assert_close(y, y64, torch.bfloat16, "y")
    cot = torch.randn(ROWS, D).bfloat16()
    got = torch.autograd.grad(y, [x, w], cot)
    want = torch.autograd.grad(y64, [x64, w64], cot.double())
    for g, e, name in zip(got, want, ("x", "weight"), strict=True):
        assert_close(g, e, torch.float32, f"grad {name}")


# ----------------------------------------------------------------- return_dropout_mask
@pytest.mark.kernel
@pytest.mark.parametrize("prenorm", [False, True])
def test_return_dropout_mask_at_p0_returns_flash_attentions_none_masks(prenorm):
    """flash-attention allocates no mask at dropout_p=0 (layer_norm.py's _layer_norm_fwd) and
    returns None for each, after y (and residual_out): the same tuple, y unchanged."""
    x, r, w = torch.randn(ROWS, D), torch.randn(ROWS, D), torch.randn(D)
    x1 = torch.randn(ROWS, D)
    got = layer_norm_fn(x, w, None, residual=r, x1=x1, prenorm=prenorm, return_dropout_mask=True)
    want = layer_norm_fn(x, w, None, residual=r, x1=x1, prenorm=prenorm)
    want = want if prenorm else (want,)
    assert len(got) == len(want) + 2 and got[-2:] == (None, None)
    for a, e in zip(got, want, strict=False):
        assert torch.equal(a, e)


# ----------------------------------------------------------------- layer_norm_linear_fn
LINEAR_CASES = {
    "rms-residual-prenorm": dict(rms=True, residual=True, prenorm=True),
    "layer-bias-fp32-stream": dict(rms=False, bias=True, prenorm=True, residual_in_fp32=True),
    "layer-plain": dict(rms=False, bias=True),
}


@pytest.mark.kernel
@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_layer_norm_linear_fn_against_fp64(case):
    """F.linear(N(residual + x)) and residual_out, values and every gradient, against fp64."""
    c = LINEAR_CASES[case]
    n_out = 5
    x = (torch.randn(2, ROWS // 2, D) * 2).requires_grad_(True)
    nw = (torch.randn(D) * 0.3 + 1.0).requires_grad_(True)
    nb = torch.randn(D).requires_grad_(True) if c.get("bias") else None
    lw, lb = torch.randn(n_out, D).requires_grad_(True), torch.randn(n_out).requires_grad_(True)
    r = torch.randn(2, ROWS // 2, D).requires_grad_(True) if c.get("residual") else None
    got = layer_norm_linear_fn(x, nw, nb, lw, lb, residual=r, eps=1e-5, prenorm=c.get("prenorm", False),
                               residual_in_fp32=c.get("residual_in_fp32", False), is_rms_norm=c["rms"])
    leaves = [t for t in (x, nw, nb, lw, lb, r) if t is not None]
    leaves64 = [leaf64(t) for t in leaves]
    it = iter(leaves64)
    x64, nw64, nb64, lw64, lb64, r64 = (next(it) if t is not None else None for t in (x, nw, nb, lw, lb, r))
    s64 = x64 if r64 is None else x64 + r64
    out64 = torch.nn.functional.linear(norm64(s64, nw64, nb64, 1e-5, c["rms"], False), lw64, lb64)
    cot = torch.randn(2, ROWS // 2, n_out)
    if c.get("prenorm"):
        out, res = got
        assert res.dtype == torch.float32
        assert_close(res, s64, torch.float32, "residual_out")
        cot_r = torch.randn(x.shape)
        outs, outs64, cots = (out, res), (out64, s64), (cot, cot_r)
    else:
        out = got
        outs, outs64, cots = (out,), (out64,), (cot,)
    assert out.dtype == x.dtype
    assert_close(out, out64, torch.float32, "out")
    g = torch.autograd.grad(outs, leaves, cots)
    g64 = torch.autograd.grad(outs64, leaves64, [t.double() for t in cots])
    for i, (a, e) in enumerate(zip(g, g64, strict=True)):
        assert_close(a, e, torch.float32, f"grad {i}")


@pytest.mark.kernel
def test_layer_norm_linear_fn_runs_the_linear_in_xs_dtype():
    """As flash-attention: a linear_weight of another dtype is cast to the norm output's
    (x's), and its gradient comes back in its own dtype; without prenorm one tensor."""
    x = torch.randn(ROWS, D).bfloat16()
    nw, lw = torch.ones(D), torch.randn(3, D, requires_grad=True)
    out = layer_norm_linear_fn(x, nw, None, lw, None, is_rms_norm=True)
    assert out.dtype == torch.bfloat16 and out.shape == (ROWS, 3)
    out.float().sum().backward()
    assert lw.grad.dtype == torch.float32


@pytest.mark.parametrize("kw,error,needle", [
    (dict(linear_weight="w"), TypeError, "linear_weight"),
    (dict(linear_bias=torch.ones(3, dtype=torch.int64)), TypeError, "linear_bias"),
    (dict(prenorm=1), TypeError, "prenorm"),
    (dict(norm_weight=torch.ones(D + 1)), ValueError, "norm_weight"),
])
def test_layer_norm_linear_fn_refuses_by_name(kw, error, needle):
    args = dict(x=torch.randn(ROWS, D), norm_weight=torch.ones(D), norm_bias=None, linear_weight=torch.randn(3, D),
                linear_bias=None)
    args.update(kw)
    with pytest.raises(error, match=needle):
        layer_norm_linear_fn(**args)


# ----------------------------------------------------------------- RMSNorm.drop
@pytest.mark.kernel
def test_rms_norm_module_has_flash_attentions_drop():
    """`drop` is an nn.Dropout(dropout_p), or None at 0, as flash-attention's; forward reads
    drop.p, so code that sets it (or reads it) sees the module follow."""
    assert RMSNorm(D).drop is None
    norm = RMSNorm(D, dropout_p=0.25)
    assert isinstance(norm.drop, nn.Dropout) and norm.drop.p == 0.25
    assert list(norm.state_dict()) == ["weight"]
    x, r = torch.randn(ROWS, D), torch.randn(ROWS, D)
    assert ((norm(x, r, prenorm=True)[1] - r) == 0).any()  # dropout in training
    norm.drop.p = 0.0
    assert torch.equal(norm(x, r, prenorm=True)[1], x + r)  # and none once drop.p is 0
