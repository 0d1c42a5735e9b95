"""weight_offset (issue 14.2): out = N(p) * (weight_offset + weight) + bias, the sum formed
in fp32 in the kernels and the torch path, forward and backward, against the fp64 reference
given the effective weight."""
import pytest
import torch
from helpers import assert_close
from ref64 import add_norm64, leaf64

import fuseblock


def _check(x, residual, w, b, offset, **kw):
    leaves = [t.detach().requires_grad_() for t in (x, residual, w, b) if t is not None]
    xs, rs = leaves[0], leaves[1] if residual is not None else None
    ws, bs = leaves[-2 if b is not None else -1], leaves[-1] if b is not None else None
    out, _ = fuseblock.add_norm(xs, rs, ws, bs, weight_offset=offset, **kw)
    ref_leaves = [leaf64(t) for t in leaves]
    rx, rr = ref_leaves[0], ref_leaves[1] if residual is not None else None
    rw, rb = ref_leaves[-2 if b is not None else -1], ref_leaves[-1] if b is not None else None
    rdtype = None if residual is None else torch.promote_types(x.dtype, residual.dtype)
    ref, _ = add_norm64(rx, rr, rw + offset, rb, residual_dtype=rdtype, **kw)
    assert_close(out, ref, x.dtype, "out")
    cot = torch.randn_like(out)
    for t, g, rg in zip(leaves, torch.autograd.grad(out, leaves, cot),
                        torch.autograd.grad(ref, ref_leaves, cot.double()), strict=True):
        assert_close(g, rg, t.dtype, "grad")


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer", "l2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_weight_values_and_gradients(kind, dtype):
    x, r = torch.randn(6, 48, dtype=dtype), torch.randn(6, 48, dtype=dtype)
    w = (torch.randn(48) * 0.1).to(dtype)
    b = torch.randn(48, dtype=dtype) if kind == "layer" else None
    _check(x, r, w, b, 1.0, kind=kind)
    _check(x, None, w, b, -0.5, kind=kind, gate=torch.randn(6, 48, dtype=dtype), gate_position="pre")


@pytest.mark.kernel
def test_offset_through_the_wide_row_kernels(small_wide_rows):
    x, w = torch.randn(5, 40), torch.randn(40) * 0.1
    _check(x, torch.randn(5, 40), w, torch.randn(40), 1.0, kind="layer")
    _check(x, None, w, None, 1.0, kind="rms", gate=torch.randn(5, 40), gate_position="post")


@pytest.mark.kernel
def test_the_sum_is_formed_in_fp32_not_the_weights_dtype():
    """Gemma's 1 + w with a small bf16 w: rounded to bf16, 1 + 1e-3 is 1.0 and the
    weight's effect is lost; formed in fp32 it survives."""
    x = torch.randn(4, 64)
    w = torch.full((64,), 1e-3, dtype=torch.bfloat16)
    got = fuseblock.norm(x, w, weight_offset=1.0)
    exact = fuseblock.norm(x, w.float() + 1.0)
    rounded = fuseblock.norm(x, (w.float() + 1.0).bfloat16())
    torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)
    assert (got - rounded).abs().max() > 1e-4


def test_offset_errors_name_the_argument():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight_offset.*needs a weight"):
        fuseblock.norm(x, weight_offset=1.0)
    with pytest.raises(ValueError, match="weight_offset must be finite"):
        fuseblock.norm(x, torch.ones(8), weight_offset=float("inf"))
    with pytest.raises(TypeError, match="weight_offset must be a real number"):
        fuseblock.norm(x, torch.ones(8), weight_offset=True)
    assert torch.equal(fuseblock.norm(x, weight_offset=0.0), fuseblock.norm(x))
