"""Norm's `elementwise_affine` and `bias` as nn.LayerNorm and nn.RMSNorm take them: the
same parameters, state_dicts that load both ways, and the same function."""
import pytest
import torch
from helpers import assert_close
from ref64 import leaf64
from torch import nn

import fuseblock

D = 8

# (fuseblock.Norm keywords, the torch module with the same parameters)
TWINS = {
    "layer-no-affine": (dict(kind="layer", eps=1e-5, elementwise_affine=False),
                        lambda: nn.LayerNorm(D, eps=1e-5, elementwise_affine=False)),
    # torch ignores bias=True without elementwise_affine: so does Norm
    "layer-no-affine-bias": (dict(kind="layer", eps=1e-5, elementwise_affine=False, bias=True),
                             lambda: nn.LayerNorm(D, eps=1e-5, elementwise_affine=False, bias=True)),
    "layer-no-bias": (dict(kind="layer", eps=1e-5, bias=False), lambda: nn.LayerNorm(D, eps=1e-5, bias=False)),
    "layer-bias": (dict(kind="layer", eps=1e-5, bias=True), lambda: nn.LayerNorm(D, eps=1e-5, bias=True)),
    "rms-no-affine": (dict(eps=1e-6, elementwise_affine=False),
                      lambda: nn.RMSNorm(D, eps=1e-6, elementwise_affine=False)),
}


def randomize(mod):
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p))
    return mod


@pytest.mark.kernel
@pytest.mark.parametrize("name", list(TWINS))
def test_state_dicts_load_both_ways_and_the_function_is_torchs(name):
    kw, make = TWINS[name]
    ours, theirs = fuseblock.Norm(D, **kw), randomize(make())
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    randomize(ours)
    theirs.load_state_dict(ours.state_dict())
    x = (3 * torch.randn(5, D) + 1).requires_grad_(True)
    x64 = leaf64(x)
    ref = theirs.double()(x64)
    cot = torch.randn(5, D)
    (want,) = torch.autograd.grad(ref, [x64], cot.double())
    for form in (ours, ours.naive):
        out = form(x)
        assert_close(out, ref, torch.float32, "out")
        (dx,) = torch.autograd.grad(out, [x], cot)
        assert_close(dx, want, torch.float32, "dx")


def test_elementwise_affine_false_drops_both_parameters_and_shows_in_the_repr():
    norm = fuseblock.Norm(D, kind="layer", elementwise_affine=False, bias=True)
    assert norm.weight is None and norm.bias is None and list(norm.parameters()) == []
    assert repr(norm) == "Norm((8,), kind='layer', eps=None, elementwise_affine=False)"
    # today's keywords keep their meaning
    assert fuseblock.Norm(D, weight=False, bias=True).bias is not None
    assert fuseblock.Norm(D, kind="layer", bias=False).weight is not None


@pytest.mark.parametrize("kw,error,needle", [
    (dict(elementwise_affine=1), TypeError, "elementwise_affine"),
    (dict(elementwise_affine=False, weight_offset=1.0), ValueError, "weight_offset"),
])
def test_bad_elementwise_affine(kw, error, needle):
    with pytest.raises(error, match=needle):
        fuseblock.Norm(D, **kw)
