"""The habits of torch.nn modules that fuseblock's modules keep: deferred (meta-device)
initialization through reset_parameters."""
import pytest
import torch
from torch import nn

import fuseblock

D = 8

# (id, factory(**factory_kwargs)): every fuseblock module that owns parameters or buffers
MODULES = {
    "Norm": lambda **f: fuseblock.Norm(D, **f),
    "Norm-layer-bias": lambda **f: fuseblock.Norm(D, kind="layer", bias=True, **f),
    "AddNorm": lambda **f: fuseblock.AddNorm(D, bias=True, **f),
    "BatchNorm": lambda **f: fuseblock.BatchNorm(D, **f),
    "BatchNorm-noaffine": lambda **f: fuseblock.BatchNorm(D, affine=False, **f),
    "InstanceNorm-affine": lambda **f: fuseblock.InstanceNorm(D, affine=True, **f),
}


def state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


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
