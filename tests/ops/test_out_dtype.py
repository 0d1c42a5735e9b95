"""out_dtype on every op form that returns a normed output (norm, add_norm, its gated and
branch forms; norm_add_norm in test_out_dtype_norm_add.py, norm_linear in
test_fp8_linear.py, the flash-attention entries in tests/nn/test_compat_flash_attn.py):
bf16 x with an fp32 out_dtype is the fp32 result stored once (fp32 accuracy against
tests/ref64.py, not bf16's), the gradient at out read in fp32, the input gradients
against ref64; fp32 x with a bf16 out_dtype is the fp32 result rounded once."""
import pytest
import torch
from helpers import generator
from ref64 import add_norm64, tolerances

import fuseblock

FORMS = {
    "norm": lambda t, **kw: (fuseblock.norm(t["x"], t["w"], **kw), None),
    "add_norm": lambda t, **kw: fuseblock.add_norm(t["x"], t["r"], t["w"], **kw),
    "add_norm_gated": lambda t, **kw: fuseblock.add_norm(t["x"], t["r"], t["w"], gate=t["z"], **kw),
    "add_norm_branch": lambda t, **kw: fuseblock.add_norm(t["x"], t["r"], t["w"], x1=t["x1"], alpha=0.5, **kw),
}
# rd: the stored new_residual's dtype (bf16 here), which the norm reads
REF = {
    "norm": lambda t, rd: add_norm64(t["x"], None, t["w"]),
    "add_norm": lambda t, rd: add_norm64(t["x"], t["r"], t["w"], residual_dtype=rd),
    "add_norm_gated": lambda t, rd: add_norm64(t["x"], t["r"], t["w"], gate=t["z"], residual_dtype=rd),
    "add_norm_branch": lambda t, rd: add_norm64(t["x"], t["r"], t["w"], x1=t["x1"], alpha=0.5, residual_dtype=rd),
}


def _leaves(dtype, g):
    t = {n: torch.randn(5, 48, generator=g) for n in ("x", "r", "z", "x1")}
    t["w"] = 1 + 0.2 * torch.randn(48, generator=g)
    return {n: v.to(dtype).requires_grad_() for n, v in t.items()}


@pytest.mark.kernel
@pytest.mark.parametrize("form", list(FORMS))
def test_fp32_out_of_bf16_x_is_stored_once(form):
    g = generator(0)
    t = _leaves(torch.bfloat16, g)
    out, _ = FORMS[form](t, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    dout = torch.randn(5, 48, generator=g)
    out.backward(dout)
    t64 = {n: v.detach().double().requires_grad_() for n, v in t.items()}
    out64 = REF[form](t64, torch.bfloat16)[0]
    out64.backward(dout.double())
    torch.testing.assert_close(out.double(), out64, atol=2e-5, rtol=2e-5)  # fp32's accuracy: never bf16
    atol, rtol = tolerances(torch.bfloat16)
    for n, v in t.items():
        if v.grad is not None:
            torch.testing.assert_close(v.grad.double(), t64[n].grad, atol=atol, rtol=rtol, msg=n)


@pytest.mark.kernel
@pytest.mark.parametrize("form", list(FORMS))
def test_bf16_out_of_fp32_x_rounds_once(form):
    g = generator(1)
    t = _leaves(torch.float32, g)
    with torch.no_grad():
        out, _ = FORMS[form](t, out_dtype=torch.bfloat16)
        wide, _ = FORMS[form](t)
    assert out.dtype == torch.bfloat16 and torch.equal(out, wide.bfloat16())
