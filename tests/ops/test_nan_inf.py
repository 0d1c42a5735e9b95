"""NaN and +-inf in a row follow torchao's casts and torch's ops on both paths (issue 44,
item 8): a reduction or clamp that feeds a scale or a reciprocal must propagate NaN, where
tl.max, tl.maximum and tl.minimum drop it on a GPU (and in triton 3.9's interpreter).

A NaN or an infinity in one weight column puts one in every row of the normed output:
fp8_row's scale, mxfp8's block scale and the codes must be torchao's of that output (and
the torch path's). embed_norm of a row holding a NaN is NaN, as x / clamp_min(n(x), eps)."""
import pytest
import torch
from helpers import generator

import fuseblock

torchao = pytest.importorskip("torchao")
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import LinearMMConfig  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402

pytestmark = pytest.mark.kernel
E4 = torch.float8_e4m3fn
SPECIALS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def rows_with(special: str, rows=4, d=64):
    g = generator(1)
    x, w = torch.randn(rows, d, generator=g), torch.randn(d, generator=g)
    w[37] = SPECIALS[special]  # one column of every row; the second mx block
    return x, w


def codes(t):
    """fp8 codes as floats, NaN codes equal whatever their sign bit (the sign of a NaN a
    product makes is the machine's)."""
    return t.float()


def same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("special", list(SPECIALS))
def test_fp8_row_scale_and_codes_of_a_row_with_nan_or_inf(special):
    x, w = rows_with(special)
    q = fuseblock.norm(x, w, quant="fp8_row")
    o = fuseblock.norm(x, w, out_dtype=torch.float32)
    ref = hp_tensor_to_float8_dynamic(o, E4, LinearMMConfig(), scaling_granularity=ScalingGranularity.AXISWISE,
                                      axiswise_dim=-1)
    same(q.scale, ref._scale.reciprocal())
    same(codes(q.data), codes(ref._data))
    if special == "nan":
        assert q.scale.isnan().all() and q.data.float().isnan().all()


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("special", list(SPECIALS))
def test_mxfp8_block_scale_and_codes_of_a_block_with_nan_or_inf(special, mode):
    x, w = rows_with(special)
    q = fuseblock.norm(x, w, quant=fuseblock.Fp8Recipe("mxfp8", mx_rounding=mode))
    mode_ = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}[mode]
    scale, data = to_mx(fuseblock.norm(x, w, out_dtype=torch.float32), E4, 32, mode_)
    assert torch.equal(q.scale.view(torch.uint8), scale.view(torch.uint8)), (q.scale.view(torch.uint8),
                                                                             scale.view(torch.uint8))
    same(codes(q.data), codes(data))
    if special == "nan":
        assert (q.scale.view(torch.uint8)[:, 1] == 255).all()


@pytest.mark.parametrize("ord", ["l1", "l2", "max"])
@pytest.mark.parametrize("special", list(SPECIALS))
def test_embed_norm_of_a_row_with_nan_or_inf(ord, special):
    x = torch.randn(3, 48, generator=generator(2))
    x[1, 7] = SPECIALS[special]
    y = fuseblock.embed_norm(x, ord=ord)
    p = {"l1": 1, "l2": 2, "max": float("inf")}[ord]
    # the finite rows within an ulp: the kernels multiply by the reciprocal
    want = x / torch.linalg.vector_norm(x, p, -1, keepdim=True).clamp_min(1e-12)
    torch.testing.assert_close(y, want, rtol=2e-7, atol=0, equal_nan=True)
    if special == "nan":
        assert y[1].isnan().all() and not y[[0, 2]].isnan().any()
