"""norm_add_norm(out_dtype=...): the second norm's output stored by the kernel in out_dtype
from fp32 (an fp32 out of bf16 x is not rounded to bf16 first), its gradient read in it;
values and gradients against tests/ref64.py."""
import pytest
import torch
from helpers import generator
from ref64 import add_norm64, tolerances

import fuseblock


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_add_norm_out_dtype_fp32_of_bf16_x(kind):
    g = generator(0)
    x = torch.randn(5, 48, generator=g).bfloat16().requires_grad_()
    res = torch.randn(5, 48, generator=g).requires_grad_()  # an fp32 stream: new_residual in fp32
    bw, w = ((1 + 0.2 * torch.randn(48, generator=g)).requires_grad_() for _ in range(2))
    out, new_res = fuseblock.norm_add_norm(x, res, bw, w, kind=kind, alpha=0.5, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and new_res.dtype == torch.float32
    dout = torch.randn(5, 48, generator=g)
    out.backward(dout)

    x64, res64, bw64, w64 = (t.detach().double().requires_grad_() for t in (x, res, bw, w))
    y64 = add_norm64(x64, None, bw64, kind=kind, eps=1e-5 if kind == "layer" else torch.finfo(torch.float32).eps)[0]
    p64 = res64 + 0.5 * y64
    out64 = add_norm64(p64, None, w64, kind=kind, eps=1e-5 if kind == "layer" else torch.finfo(torch.float32).eps)[0]
    out64.backward(dout.double())
    # fp32 accuracy, not bf16's (2**-8): the output was never rounded to x's dtype
    torch.testing.assert_close(out.double(), out64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=tolerances(torch.bfloat16)[0],
                               rtol=tolerances(torch.bfloat16)[1])
    for got, want in ((res.grad, res64.grad), (bw.grad, bw64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_norm_add_norm_out_dtype_is_checked():
    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match="out_dtype"):
        fuseblock.norm_add_norm(x, x, torch.ones(8), torch.ones(8), out_dtype=torch.int8)
