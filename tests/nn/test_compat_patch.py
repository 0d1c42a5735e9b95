"""fuseblock.compat.patch on stand-in packages built in the test (flash_attn and mamba_ssm are
not installed here): every module of the package that imported the norm names gets
fuseblock's, the source module too; a private name fuseblock does not provide is refused
by name with nothing patched. mamba's gated norm (fuseblock.compat.mamba_ssm) against its
reference formula written in the test, in fp64, values and every gradient."""
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import KERNEL_PATH, generator

from fuseblock.compat import flash_attn as fa
from fuseblock.compat import mamba_ssm as gated
from fuseblock.compat import patch


def _package(monkeypatch, name, modules):
    """Modules {dotted name: {attr: value}} registered under `name` in sys.modules."""
    made = {}
    for mod_name, attrs in modules.items():
        module = types.ModuleType(mod_name)
        for k, v in attrs.items():
            if isinstance(v, types.FunctionType) and v.__module__ == "source":  # defined "in" the source module
                v.__module__ = mod_name
            setattr(module, k, v)
        monkeypatch.setitem(sys.modules, mod_name, module)
        made[mod_name] = module
    for parent in {name, *(m.rsplit(".", 1)[0] for m in modules)}:
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    return made


def _source_fns():
    def rms_norm_fn(*a, **k):
        raise AssertionError("the package's own rms_norm_fn ran")

    def layer_norm_fn(*a, **k):
        raise AssertionError("the package's own layer_norm_fn ran")

    def _layer_norm_fwd(*a, **k):
        raise AssertionError("private")

    class RMSNorm(torch.nn.Module):
        pass
    for f in (rms_norm_fn, layer_norm_fn, _layer_norm_fwd):
        f.__module__ = "source"
    return dict(RMSNorm=RMSNorm, rms_norm_fn=rms_norm_fn, layer_norm_fn=layer_norm_fn, _layer_norm_fwd=_layer_norm_fwd)


def test_patch_replaces_the_names_in_every_module(monkeypatch):
    src = _source_fns()
    RMSNorm = src["RMSNorm"]
    RMSNorm.__module__ = "mamba_ssm.ops.triton.layer_norm"
    mods = _package(monkeypatch, "mamba_ssm", {
        "mamba_ssm.ops.triton.layer_norm": src,
        "mamba_ssm.ops.triton.layernorm_gated": {"RMSNorm": type("RMSNorm", (torch.nn.Module,), {}),
                                                 "rmsnorm_fn": lambda *a: None},
        "mamba_ssm.modules.mamba_simple": {k: src[k] for k in ("RMSNorm", "layer_norm_fn", "rms_norm_fn")},
        "mamba_ssm.models.mixer_seq_simple": {k: src[k] for k in ("RMSNorm", "layer_norm_fn", "rms_norm_fn")},
    })
    mods["mamba_ssm.modules.mamba2"] = _package(monkeypatch, "mamba_ssm", {"mamba_ssm.modules.mamba2": {
        "RMSNormGated": sys.modules["mamba_ssm.ops.triton.layernorm_gated"].RMSNorm}})["mamba_ssm.modules.mamba2"]
    done = patch("mamba_ssm")
    for name in ("mamba_simple", "mixer_seq_simple"):
        m = sys.modules[f"mamba_ssm.{'modules' if name == 'mamba_simple' else 'models'}.{name}"]
        assert (m.RMSNorm, m.layer_norm_fn, m.rms_norm_fn) == (fa.RMSNorm, fa.layer_norm_fn, fa.rms_norm_fn)
    assert mods["mamba_ssm.ops.triton.layer_norm"].rms_norm_fn is fa.rms_norm_fn  # later imports get fuseblock's
    assert mods["mamba_ssm.modules.mamba2"].RMSNormGated is gated.RMSNorm  # imported under another name too
    assert mods["mamba_ssm.ops.triton.layernorm_gated"].RMSNorm is gated.RMSNorm
    assert "mamba_ssm.modules.mamba_simple.rms_norm_fn" in done
    assert len(done) == 3 + 2 + 3 + 3 + 1  # the two source modules, the two users, mamba2
    # the private name stays in its own module, which uses it
    assert mods["mamba_ssm.ops.triton.layer_norm"]._layer_norm_fwd is src["_layer_norm_fwd"]
    assert patch("mamba_ssm") == []  # nothing left to replace


def test_patch_refuses_a_private_name_and_changes_nothing(monkeypatch):
    src = _source_fns()
    _package(monkeypatch, "flash_attn", {
        "flash_attn.ops.triton.layer_norm": src,
        "flash_attn.modules.block": {"RMSNorm": src["RMSNorm"], "layer_norm_fn": src["layer_norm_fn"]},
        "flash_attn.modules.mlp": {"_layer_norm_fwd": src["_layer_norm_fwd"], "rms_norm_fn": src["rms_norm_fn"]},
    })
    with pytest.raises(ValueError, match=r"flash_attn.modules.mlp uses flash_attn.ops.triton.layer_norm._layer_norm_fwd"
                                         r", which fuseblock.compat.flash_attn does not provide: nothing patched"):
        patch("flash_attn")
    assert sys.modules["flash_attn.modules.block"].layer_norm_fn is src["layer_norm_fn"]
    assert sys.modules["flash_attn.modules.mlp"].rms_norm_fn is src["rms_norm_fn"]


def test_patch_bad_package(monkeypatch):
    with pytest.raises(ValueError, match="package must be one of 'flash_attn', 'mamba_ssm'"):
        patch("apex")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # an import of it fails
    with pytest.raises(ImportError, match="cannot import flash_attn.ops.triton.layer_norm.*install flash_attn"):
        patch("flash_attn")


def _gated_ref(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm):
    """mamba's layernorm_gated reference, written from its formula, in fp64."""
    x, z = x.double(), None if z is None else z.double()
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    g = x.shape[-1] if group_size is None else group_size
    xg = x.unflatten(-1, (-1, g))
    if not is_rms_norm:
        xg = xg - xg.mean(-1, keepdim=True)
    out = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight.double()
    if bias is not None:
        out = out + bias.double()
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out


@pytest.mark.kernel
@pytest.mark.parametrize("is_rms_norm", [True, False])
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("group_size", [None, 8])
def test_gated_norm_against_its_formula(is_rms_norm, norm_before_gate, group_size):
    d = 32
    x = torch.randn(3, 5, d, generator=generator(0)).requires_grad_()
    z = torch.randn(3, 5, d, generator=generator(1)).requires_grad_()
    module = (gated.RMSNorm if is_rms_norm else gated.LayerNorm)(d, eps=1e-5, group_size=group_size,
                                                                 norm_before_gate=norm_before_gate)
    with torch.no_grad():
        module.weight.normal_(1.0, 0.2, generator=generator(2))
        if module.bias is not None:
            module.bias.normal_(0.0, 0.2, generator=generator(3))
    tensors = [x, z, *module.parameters()]
    got = module(x, z)
    want = _gated_ref(x, module.weight, module.bias, z, 1e-5, group_size, norm_before_gate, is_rms_norm)
    tol = dict(rtol=1e-4, atol=1e-5) if KERNEL_PATH else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.double(), want, **tol)
    g = torch.randn(got.shape, generator=generator(4))
    for a, b in zip(torch.autograd.grad(got, tensors, g), torch.autograd.grad(want, tensors, g.double()), strict=True):
        torch.testing.assert_close(a.double(), b.double(), **tol)
    fn = gated.rmsnorm_fn if is_rms_norm else gated.layernorm_fn
    kw = {} if is_rms_norm else dict(is_rms_norm=False)
    torch.testing.assert_close(fn(x, module.weight, module.bias, z=z, eps=1e-5, group_size=group_size,
                                  norm_before_gate=norm_before_gate, **kw), got)


def test_gated_norm_bad_group_size():
    with pytest.raises(ValueError, match=r"group_size must be a positive int dividing the last dim \(32\), got 5"):
        gated.rmsnorm_fn(torch.randn(2, 32), torch.ones(32), None, group_size=5)
