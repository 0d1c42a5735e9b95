"""fuseblock.kernels.fp8's integer encoding against torch's fp8 cast and against Triton's own
conversion, on every e4m3 value and every midpoint between neighbours (ties to even, the
carry into the exponent, subnormals). Triton's unpatched interpreter gets 70 of these 256
wrong; tests/conftest.py makes it round as a GPU does (fuseblock/testing/interpreter_rounding.py),
and the kernels' integer codes need neither: they equal torch's either way."""
import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language
from fuseblock.kernels.fp8 import fp8_codes  # noqa: E402

E4 = torch.float8_e4m3fn


@triton.jit
def _both_casts(V, NATIVE, OURS, N: tl.constexpr):
    o = tl.arange(0, N)
    v = tl.load(V + o)
    tl.store(NATIVE + o, v.to(tl.float8e4nv))
    tl.store(OURS + o, fp8_codes(v, 448.0, 3, 7))


@pytest.mark.kernel
@pytest.mark.kernel_only("runs a Triton kernel")
def test_integer_codes_equal_torchs_cast_and_the_gpu_rounding_conversion():
    pos = torch.arange(127, dtype=torch.uint8).view(E4).float().unique().sort().values
    v = torch.cat([pos, (pos[1:] + pos[:-1]) / 2])
    v = torch.nn.functional.pad(v, (0, 256 - v.numel()))
    native, ours = torch.empty(256, dtype=E4), torch.empty(256, dtype=torch.uint8)
    _both_casts[(1,)](v, native, ours, N=256)
    want = v.to(E4).view(torch.uint8)
    assert torch.equal(ours, want)
    assert torch.equal(native.view(torch.uint8), want)  # the patched interpreter, as a GPU converts
