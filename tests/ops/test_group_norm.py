"""Group norm: through num_groups of the core op (a layer norm per group of the last dim),
and group and instance norm of (N, C, L) inputs, against F.group_norm, F.instance_norm
and the nn modules in float64, values and gradients."""
import pytest
import torch
import torch.nn.functional as F
from family_helpers import WIDE, check_grads, loops
from helpers import assert_close
from ref64 import leaf64

import fuseblock


# =========================================================================== group norm via num_groups
@pytest.mark.kernel
@pytest.mark.parametrize("num_groups", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_with_groups_is_group_norm(num_groups, dtype, residual):
    # groups of >= 4 values: a group of 2 normalizes to +-1, and its gradient is all
    # cancellation (ill-conditioned in any precision, torch's own fp32 included)
    x, r = torch.randn(5, 16).to(dtype), torch.randn(5, 16).to(dtype)
    w, b = torch.randn(16).to(dtype), torch.randn(16).to(dtype)
    leaves = [t.requires_grad_(True) for t in ((x, r, w, b) if residual else (x, w, b))]
    out, _ = fuseblock.add_norm(x, r if residual else None, w, b, kind="layer", eps=1e-5, num_groups=num_groups)
    refs = [leaf64(t) for t in leaves]
    p = refs[0] + refs[1] if residual else refs[0]
    ref = F.group_norm(p, num_groups, refs[-2], refs[-1], 1e-5)
    assert_close(out, ref, dtype, "out", per_row=True)
    check_grads(out, ref, leaves, refs, dtype, ["x", "residual", "w", "b"] if residual else ["x", "w", "b"])


@pytest.mark.kernel
def test_group_norm_wide_groups_loop_kernel():
    assert loops(WIDE, 2)
    x, w, b = torch.randn(3, WIDE), torch.randn(WIDE), torch.randn(WIDE)
    leaves = [t.requires_grad_(True) for t in (x, w, b)]
    out = fuseblock.norm(x, w, b, kind="layer", eps=1e-5, num_groups=2)
    refs = [leaf64(t) for t in leaves]
    ref = F.group_norm(refs[0], 2, refs[1], refs[2], 1e-5)
    assert_close(out, ref, torch.float32, "out", per_row=True)
    check_grads(out, ref, leaves, refs, torch.float32, ["x", "w", "b"])


@pytest.mark.kernel
@pytest.mark.parametrize("num_groups", [2, 4])
def test_norm_module_with_groups_loads_nn_group_norm(num_groups):
    ref = torch.nn.GroupNorm(num_groups, 16, eps=1e-5)
    torch.nn.init.normal_(ref.weight)
    torch.nn.init.normal_(ref.bias)
    mod = fuseblock.Norm(16, kind="layer", eps=1e-5, bias=True, num_groups=num_groups)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(6, 16, requires_grad=True)
    out, ref_out = mod(x), ref(x)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, mod.weight, mod.bias), g)
    for a, b in zip(grads, torch.autograd.grad(ref_out, (x, ref.weight, ref.bias), g), strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_groups_must_divide_the_last_dim():
    x = torch.randn(2, 6)
    with pytest.raises(ValueError, match="num_groups"):
        fuseblock.norm(x, kind="layer", num_groups=4)
    with pytest.raises(ValueError, match="num_groups"):
        fuseblock.add_norm(x, x, kind="layer", num_groups=5)
    with pytest.raises(ValueError, match="num_groups"):
        fuseblock.Norm(6, kind="layer", num_groups=4)


# =========================================================================== group and instance norm of (N, C, L)
@pytest.mark.kernel
@pytest.mark.parametrize("num_groups", [1, 2, 4])
def test_group_norm_of_channels_matches_torch(num_groups):
    x, w, b = torch.randn(3, 4, 5), torch.randn(4), torch.randn(4)
    leaves = [t.requires_grad_(True) for t in (x, w, b)]
    out = fuseblock.group_norm(x, num_groups, w, b, 1e-5)
    refs = [leaf64(t) for t in leaves]
    ref = F.group_norm(refs[0], num_groups, refs[1], refs[2], 1e-5)
    assert_close(out, ref, torch.float32, "out", per_row=True)
    check_grads(out, ref, leaves, refs, torch.float32, ["x", "w", "b"])


@pytest.mark.kernel
@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 3, 2, 3)], ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_instance_norm_matches_torch(shape, affine):
    c = shape[1]
    x = torch.randn(shape)
    w, b = (torch.randn(c), torch.randn(c)) if affine else (None, None)
    leaves = [t.requires_grad_(True) for t in (x, w, b) if t is not None]
    out = fuseblock.instance_norm(x, w, b, 1e-5)
    refs = [leaf64(t) for t in leaves]
    ref = F.instance_norm(refs[0], weight=refs[1] if affine else None, bias=refs[2] if affine else None, eps=1e-5)
    assert_close(out, ref, torch.float32, "out", per_row=True)
    check_grads(out, ref, leaves, refs, torch.float32, ["x", "w", "b"])


def test_instance_norm_module_loads_nn_instance_norm():
    ref = torch.nn.InstanceNorm1d(4, affine=True)
    torch.nn.init.normal_(ref.weight)
    mod = fuseblock.InstanceNorm(4, affine=True)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4, 7)
    torch.testing.assert_close(mod(x), ref(x), atol=2e-5, rtol=2e-5)
    assert list(fuseblock.InstanceNorm(4).state_dict()) == list(torch.nn.InstanceNorm1d(4).state_dict()) == []
