"""fuseblock.compat.flash_attn: flash-attention's layer_norm_fn / rms_norm_fn / RMSNorm
signatures, the calls mamba-style code makes, against an fp64 reference written here
(values and gradients, both paths); dropout by its statistics; what fuseblock lacks
refused by name."""
import inspect

import pytest
import torch
from helpers import assert_close
from ref64 import leaf64

from fuseblock.compat.flash_attn import RMSNorm, layer_norm_fn, rms_norm_fn

D, ROWS = 16, 6

# flash-attention's signature (flash_attn/ops/triton/layer_norm.py), in order, with defaults
FLASH_LAYER_NORM_FN = [("x", None), ("weight", None), ("bias", None), ("residual", None), ("x1", None),
                       ("weight1", None), ("bias1", None), ("eps", 1e-6), ("dropout_p", 0.0), ("rowscale", None),
                       ("prenorm", False), ("residual_in_fp32", False), ("zero_centered_weight", False),
                       ("is_rms_norm", False), ("return_dropout_mask", False), ("out_dtype", None), ("out", None),
                       ("residual_out", None)]


def params(fn):
    return [(p.name, None if p.default is p.empty else p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_signatures_are_flash_attentions():
    assert params(layer_norm_fn) == FLASH_LAYER_NORM_FN
    assert params(rms_norm_fn) == [p for p in FLASH_LAYER_NORM_FN if p[0] != "is_rms_norm"]
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
    (dict(return_dropout_mask=True), ValueError, "return_dropout_mask"),
    (dict(prenorm="yes"), TypeError, "prenorm"),
    (dict(is_rms_norm=1), TypeError, "is_rms_norm"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(x1=torch.randn(ROWS, D + 1)), ValueError, "x1"),
    (dict(out_dtype="bf16"), TypeError, "out_dtype"),
])
def test_what_fuseblock_lacks_is_refused_by_name(kw, error, needle):
    with pytest.raises(error, match=needle):
        layer_norm_fn(torch.randn(ROWS, D), torch.ones(D), None, **kw)
