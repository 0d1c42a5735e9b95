"""fuseblock.kernels.fp8's integer encoding against Triton's own fp8 conversion under
TRITON_INTERPRET=1, which rounds wrongly (ties, the carry into the exponent, subnormals):
where the two differ, the integer codes equal torch's cast."""
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
@pytest.mark.kernel_only("the interpreter's own fp8 conversion is what this measures")
def test_integer_codes_are_right_where_the_interpreters_cast_is_not():
    """Triton's conversion under TRITON_INTERPRET=1 against torch's: where they differ the
    kernel's integer encoding (fuseblock.kernels.fp8.fp8_codes) still equals torch."""
    pos = torch.arange(127, dtype=torch.uint8).view(E4).float().unique().sort().values
    v = torch.cat([pos, (pos[1:] + pos[:-1]) / 2])
    v = torch.nn.functional.pad(v, (0, 256 - v.numel()))
    native, ours = torch.empty(256, dtype=E4), torch.empty(256, dtype=torch.uint8)
    _both_casts[(1,)](v, native, ours, N=256)
    want = v.to(E4).view(torch.uint8)
    assert torch.equal(ours, want)
    wrong = (native.view(torch.uint8) != want).sum().item()
    print(f"interpreter's own fp8 cast: {wrong} of 256 codes wrong")
