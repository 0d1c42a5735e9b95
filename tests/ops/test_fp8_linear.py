"""norm_linear(quant=...) / NormLinear(quant=...): the rowwise fp8 recipe and mxfp8.

The backward is the unquantized one (the gradient at the normed output in high
precision): every gradient equals norm_linear's without quant, bit for bit, for the same
incoming gradient. fp8_row's outputs and gradients match torchao's Float8Linear (rowwise
recipe) applied to the unfused norm's output within the SQNR bounds torchao's own tests
set for Float8Linear (below). mxfp8's output equals the unfused norm cast by torchao's
to_mx, dequantized by torchao's to_dtype and multiplied in fp32 (the fallback's math),
bit for bit; its block-scale layout for torch._scaled_mm equals torchao's to_blocked."""
import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import generator

import fuseblock
from fuseblock import Fp8Recipe
from fuseblock.reference.fp8 import mx_block_mm_native

pytest.importorskip("torchao")
from torchao.float8 import Float8LinearConfig  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_utils import compute_error  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx  # noqa: E402
from torchao.prototype.mx_formats.utils import to_blocked  # noqa: E402

# torchao's tolerances for Float8Linear (pytorch/ao at 36027d8, the recipe "rowwise"):
# test/float8/test_base.py, TestFloat8Linear._test_linear_impl (run by test_linear_from_recipe):
#   y_sqnr >= 18.0, the weight gradient's g_sqnr >= 17.0, the bias gradient assert_close;
# test/float8/test_numerics_integration.py, _test_impl (run by test_encoder_fw_bw_from_recipe):
#   out_sqnr > 20.0 and every parameter's gradient sqnr > 20.0.
# The stricter of each is held here, to torchao's Float8Linear and to the high-precision model.
Y_SQNR = 20.0
GRAD_SQNR = 20.0
MODES = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}
E4 = torch.float8_e4m3fn


def _grads(fn, leaves, dy):
    for t in leaves:
        t.grad = None
    y, new_res = fn()
    torch.autograd.backward([y, new_res], [dy, torch.ones_like(new_res)])
    return y, [t.grad.clone() for t in leaves]


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_fp8_backward_equals_the_unquantized_one(kind):
    g = generator(0)
    x, res = (torch.randn(6, 64, generator=g).requires_grad_() for _ in range(2))
    nw = (1 + 0.1 * torch.randn(64, generator=g)).requires_grad_()
    nb = (0.1 * torch.randn(64, generator=g)).requires_grad_() if kind == "layer" else None
    w = (0.1 * torch.randn(48, 64, generator=g)).requires_grad_()
    b = torch.randn(48, generator=g).requires_grad_()
    dy = torch.randn(6, 48, generator=g)
    leaves = [t for t in (x, res, nw, nb, w, b) if t is not None]
    run = {q: _grads(lambda q=q: fuseblock.norm_linear(x, res, nw, nb, w, b, kind=kind, quant=q), leaves, dy)
           for q in (None, "fp8_row")}
    for got, want in zip(run["fp8_row"][1], run[None][1], strict=True):
        assert torch.equal(got, want)
    y8, y = run["fp8_row"][0], run[None][0]
    assert not torch.equal(y8, y) and compute_error(y, y8) > 25  # the forward is quantized, and close


@pytest.mark.kernel
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_norm_linear_matches_torchao_float8_linear_rowwise(bias):
    torch.manual_seed(0)
    x = torch.randn(4, 16, 128, dtype=torch.bfloat16)
    ours = fuseblock.NormLinear(128, 96, bias=bias, quant="fp8_row", dtype=torch.bfloat16)
    with torch.no_grad():
        ours.norm_weight.uniform_(0.5, 1.5)
    lin = torch.nn.Linear(128, 96, bias=bias, dtype=torch.bfloat16)
    lin.load_state_dict({k: v for k, v in ours.state_dict().items() if k in ("weight", "bias")})
    theirs = Float8Linear.from_float(copy.deepcopy(lin), config=Float8LinearConfig.from_recipe_name("rowwise"))
    dy = torch.randn(4, 16, 96, dtype=torch.bfloat16)

    def unfused(linear):
        xx, nw = x.clone().requires_grad_(), ours.norm_weight.detach().clone().requires_grad_()
        y = linear(fuseblock.norm(xx, nw))  # the unfused norm's output into the Linear
        y.backward(dy)
        return y, xx.grad, nw.grad

    xa = x.clone().requires_grad_()
    ya, _ = ours(xa)
    ya.backward(dy)
    for (y, dx, dnw), model in ((unfused(theirs), theirs), (unfused(lin), lin)):  # torchao's fp8 Linear; bf16
        assert compute_error(y, ya) > Y_SQNR
        assert compute_error(dx, xa.grad) > GRAD_SQNR and compute_error(dnw, ours.norm_weight.grad) > GRAD_SQNR
        assert compute_error(model.weight.grad, ours.weight.grad) > GRAD_SQNR
        if bias:
            torch.testing.assert_close(model.bias.grad, ours.bias.grad)


def _deq(scale, data, dtype=torch.float32):
    return to_dtype(data, scale, E4, 32, dtype)


@pytest.mark.kernel
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mxfp8_norm_linear_equals_unfused_norm_to_mx_and_the_fallback(rounding):
    """y = the unfused norm's fp32 output and the weight, each cast by torchao's to_mx
    (blocks of 32 along the features), dequantized by torchao and multiplied in fp32, then
    cast to x's dtype and the bias added (`fuseblock.reference.fp8.mx_linear`'s fallback, which the
    CPU takes; bit for bit there, within 1e-5 of the largest |y| where torch._scaled_mm
    takes the block scales, sm_100 and later). The gradients are norm_linear's without quant, bit for bit, and close to
    the unfused norm + F.linear's."""
    g = generator(0)
    x, res = (torch.randn(6, 64, generator=g).requires_grad_() for _ in range(2))
    nw = (1 + 0.2 * torch.randn(64, generator=g)).requires_grad_()
    w, b = (0.1 * torch.randn(48, 64, generator=g)).requires_grad_(), torch.randn(48, generator=g).requires_grad_()
    dy = torch.randn(6, 48, generator=g)
    leaves = [x, res, nw, w, b]
    recipe = Fp8Recipe("mxfp8", mx_rounding=rounding)
    y8, grads8 = _grads(lambda: fuseblock.norm_linear(x, res, nw, None, w, b, quant=recipe), leaves, dy)
    with torch.no_grad():
        o = fuseblock.add_norm(x, res, nw, out_dtype=torch.float32)[0]
        want = _deq(*to_mx(o, E4, 32, MODES[rounding])) @ _deq(*to_mx(w, E4, 32, MODES[rounding])).t() + b
    if mx_block_mm_native(y8.device):  # cuBLAS's block-scaled product sums in its own order: not the fp32 matmul's bits
        torch.testing.assert_close(y8, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:
        assert torch.equal(y8, want)
    # the module runs the same op: the mode's name is the default (floor) recipe
    module = fuseblock.NormLinear(64, 48, quant="mxfp8" if rounding == "floor" else recipe)
    with torch.no_grad():
        for name, t in (("norm_weight", nw), ("weight", w), ("bias", b)):
            getattr(module, name).copy_(t)
        assert torch.equal(module(x, res)[0], y8)
    _, grads = _grads(lambda: fuseblock.norm_linear(x, res, nw, None, w, b), leaves, dy)
    for got, plain in zip(grads8, grads, strict=True):
        assert torch.equal(got, plain)
    _, unfused = _grads(lambda: (lambda o, r: (F.linear(o, w, b), r))(*fuseblock.add_norm(x, res, nw)), leaves, dy)
    for got, ref in zip(grads8, unfused, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_mx_block_scale_layout_equals_torchaos_to_blocked():
    from fuseblock.reference.fp8 import blocked_scales
    for rows, cols in ((128, 4), (200, 6), (3, 1)):
        s = torch.randint(0, 255, (rows, cols), dtype=torch.uint8).view(torch.float8_e8m0fnu)
        assert torch.equal(blocked_scales(s).view(torch.uint8), to_blocked(s).reshape(-1).view(torch.uint8))


@pytest.mark.kernel
def test_norm_linear_out_dtype_is_the_linears_input_dtype():
    """fp32 x (a wide residual stream), bf16 Linear: the norm writes its rows in bf16 from
    fp32 and the Linear runs in bf16; values and gradients as the unfused
    add_norm(out_dtype=bf16) + F.linear's."""
    g = generator(1)
    x, res = (torch.randn(6, 64, generator=g).requires_grad_() for _ in range(2))
    nw = (1 + 0.2 * torch.randn(64, generator=g)).requires_grad_()
    w = (0.1 * torch.randn(48, 64, generator=g)).bfloat16().requires_grad_()
    dy = torch.randn(6, 48, generator=g).bfloat16()
    leaves = [x, res, nw, w]
    y, grads = _grads(lambda: fuseblock.norm_linear(x, res, nw, None, w, out_dtype=torch.bfloat16), leaves, dy)
    y0, grads0 = _grads(lambda: (lambda o, r: (F.linear(o, w), r))(
        *fuseblock.add_norm(x, res, nw, out_dtype=torch.bfloat16)), leaves, dy)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y0)
    for got, want in zip(grads, grads0, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_norm_linear_quant_bad_input():
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match="'fp8_row'.*'mxfp8'"):
        fuseblock.norm_linear(x, None, None, None, w, quant="fp8_tensor")
    with pytest.raises(TypeError, match="weight in x's dtype"):
        fuseblock.norm_linear(x, None, None, None, w.double(), quant="fp8_row")
    with pytest.raises(ValueError, match="quant must be"):
        fuseblock.NormLinear(64, 8, quant="fp8")
    with pytest.raises(ValueError, match="multiple of 32.*pad the row"):
        fuseblock.norm_linear(torch.randn(2, 48), None, None, None, torch.randn(8, 48), quant="mxfp8")
    with pytest.raises(ValueError, match="'fp8_row'.*'mxfp8'"):
        fuseblock.NormLinear(64, 8, quant=Fp8Recipe("fp8_tensor"))
    for bad in (Fp8Recipe("fp8_row", quant_from=torch.bfloat16), Fp8Recipe("mxfp8", mx_columnwise=True)):
        with pytest.raises(ValueError, match="no quant_from and no mx_columnwise"):
            fuseblock.norm_linear(x, None, None, None, w, quant=bad)
        with pytest.raises(ValueError, match="no quant_from and no mx_columnwise"):
            fuseblock.NormLinear(64, 8, quant=bad)
    with pytest.raises(TypeError, match=r"no mx_rounding= any more.*Fp8Recipe"):
        fuseblock.norm_linear(x, None, None, None, w, quant="mxfp8", mx_rounding="rceil")
    with pytest.raises(ValueError, match="out_dtype and quant"):
        fuseblock.norm_linear(x, None, None, None, w, quant="fp8_row", out_dtype=torch.float32)
    with pytest.raises(TypeError, match="out_dtype"):
        fuseblock.norm_linear(x, None, None, None, w, out_dtype="bf16")
    with pytest.raises(TypeError, match="out_dtype is the Linear's input dtype"):
        fuseblock.norm_linear(x, None, None, None, w, out_dtype=torch.bfloat16)


@pytest.mark.kernel
def test_norm_linear_fp8_row_scale_ub_bounds_the_rows_amax():
    """y = _scaled_mm of norm(quant="fp8_row", scale_ub=...)'s codes and torchao's rowwise
    cast of the weight, bit for bit; the bound changes y."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    torch.manual_seed(0)
    x, w = torch.randn(4, 64), torch.randn(8, 64)
    got = fuseblock.norm_linear(x, None, None, None, w, quant=Fp8Recipe("fp8_row", scale_ub=0.5))[0]
    q = fuseblock.norm(x, quant=Fp8Recipe("fp8_row", scale_ub=0.5))
    wq = hp_tensor_to_float8_dynamic(w, E4, LinearMMConfig(), scaling_granularity=ScalingGranularity.AXISWISE,
                                     axiswise_dim=-1)
    want = torch._scaled_mm(q.data, wq._data.t(), scale_a=q.scale, scale_b=wq._scale.reciprocal().reshape(1, -1),
                            out_dtype=torch.float32)
    assert torch.equal(got, want)
    assert not torch.equal(got, fuseblock.norm_linear(x, None, None, None, w, quant="fp8_row")[0])


def test_norm_linear_quant_attribute_routes_add_linear_to_fp8():
    """Norm.linear_quant (set by scripts/train.py --fp8 row) makes add_linear the fp8 recipe."""
    torch.manual_seed(0)
    x, lin, n = torch.randn(4, 64), torch.nn.Linear(64, 32), fuseblock.Norm(64)
    plain = n.add_linear(x, None, lin)[0]
    n.linear_quant = "fp8_row"
    got = n.add_linear(x, None, lin)[0]
    want = fuseblock.norm_linear(x, None, n.weight, None, lin.weight, lin.bias, quant="fp8_row")[0]
    assert torch.equal(got, want) and not torch.equal(got, plain)


@pytest.mark.parametrize("gpu,out_dtype,problem", [
    (dict(cap=(9, 0), name="NVIDIA H100"), torch.bfloat16, None),
    (dict(cap=(9, 0), name="NVIDIA H100"), torch.float16, "NVIDIA H100 (sm_90) outputs torch.bfloat16 only"),
    (dict(cap=(9, 0), name="NVIDIA H100"), torch.float32, "y would be torch.float32"),
    (dict(cap=(10, 0), name="NVIDIA B200"), torch.float16, None),
    (dict(cap=(10, 0), name="NVIDIA B200"), torch.float32, "B200 (sm_100) outputs torch.bfloat16 or torch.float16"),
    (dict(hip="6.4", arch="gfx942:sramecc+:xnack-", name="AMD Instinct MI300X"), torch.bfloat16,
     "MI300X (gfx942) multiplies fp8 as float8_e4m3fnuz"),
    (dict(hip="6.4", arch="gfx950", name="AMD Instinct MI355X"), torch.bfloat16, None),
], ids=["h100-bf16", "h100-fp16", "h100-fp32", "b200-fp16", "b200-fp32", "mi300x", "mi355x"])
def test_fp8_row_linear_names_the_gpu_and_dtype_scaled_mm_refuses(monkeypatch, gpu, out_dtype, problem):
    import types

    from fuseblock.reference import fp8

    monkeypatch.setattr(torch.version, "hip", gpu.get("hip"), raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: gpu["name"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: gpu.get("cap", (9, 4)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: types.SimpleNamespace(
        gcnArchName=gpu.get("arch", "")))
    monkeypatch.setattr(fp8, "_MM_PROBLEMS", {})
    got = fp8.rowwise_mm_problem(torch.device("cuda", 0), out_dtype, E4)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got, got
    assert fp8.rowwise_mm_problem(torch.device("cpu"), torch.float32, E4) is None


def test_fp8_row_linear_refuses_what_scaled_mm_refuses_before_it_runs(monkeypatch):
    from fuseblock.reference import fp8

    monkeypatch.setattr(fp8, "rowwise_mm_problem", lambda device, out_dtype, fp8_dtype: f"no {out_dtype} here")
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"norm_linear\(quant='fp8_row'\): no torch.float32 here"):
        fuseblock.norm_linear(x, None, None, None, w, quant="fp8_row")
    fuseblock.norm_linear(x, None, None, None, w, quant="mxfp8")  # the block-scaled product is not rowwise
